"""Reading Hermes tool calls out of text while it streams, arguments included, as they are
generated (as vLLM's ``hermes`` parser does).

:class:`CallStream` turns text deltas into events, in order:

- ``str``: content (only what comes before the first call; what could be the start of
  ``<tool_call>`` is held back until it is known not to be);
- :class:`CallStart`: a call's id and name, once ``{"name": "...", "arguments": `` was read;
- :class:`ArgumentsDelta`: the next characters of that call's arguments, the JSON text exactly as
  the model writes it (the same text the whole call's ``arguments`` will hold);
- :class:`~kvstrata.server.tools.ToolCall`: the call is complete (its block closed, or the output
  ended after a complete value). A call whose block does not start in that form (fields in
  another order, ``parameters``) is released whole, as this event alone.

The events of a stream carry the same calls, with the same arguments text, as
:func:`~kvstrata.server.tools.parse_calls` reads from the whole text. Where they cannot agree
is malformed output after a call's header went out: the call then ends with the arguments that
were streamed (``cut`` when the output ended inside them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from kvstrata.server.tools import CALL_CLOSE, CALL_OPEN, ToolCall, new_call_id, parse_call

_WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


Event = str | CallStart | ArgumentsDelta | ToolCall


class _ValueEnd:
    """Finds where a JSON value ends, fed a character at a time (strings and nesting tracked)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.scalar = False
        self.done = False

    def feed(self, char: str) -> bool:
        """Whether ``char`` belongs to the value (False: the value ended before it)."""
        if self.done:
            return False
        if not self.started:
            self.started = True
            self.scalar = char not in '{["'
            if char == '"':
                self.in_string = True
                return True
            if char in "{[":
                self.depth = 1
                return True
            return True
        if self.scalar:  # a number or a literal ends at the first delimiter
            if char in _WHITESPACE + ",}]":
                self.done = True
                return False
            return True
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                self.done = self.depth == 0
            return True
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


NEED = "need"
NO = "no"


def read_header(block: str) -> tuple[str, int] | str:
    """``(name, where the arguments start)`` when ``block`` starts ``{"name": "...",
    "arguments": `` and a value follows; :data:`NEED` while it still might; :data:`NO` when it
    cannot."""
    at = 0
    name = ""
    for piece in ("{", '"name"', ":", None, ",", '"arguments"', ":"):
        while at < len(block) and block[at] in _WHITESPACE:
            at += 1
        if at == len(block):
            return NEED
        if piece is None:  # the name: a JSON string
            if block[at] != '"':
                return NO
            end, escaped = at + 1, False
            while end < len(block) and (escaped or block[end] != '"'):
                escaped = not escaped and block[end] == "\\"
                end += 1
            if end == len(block):
                return NEED
            try:
                name = json.loads(block[at : end + 1])
            except ValueError:
                return NO
            at = end + 1
        elif block.startswith(piece, at):
            at += len(piece)
        elif piece.startswith(block[at:]):
            return NEED
        else:
            return NO
    while at < len(block) and block[at] in _WHITESPACE:
        at += 1
    return (name, at) if at < len(block) else NEED


class CallStream:
    """Reads calls out of streamed text (see the module's docstring for the events)."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet released; inside a call: the call's block so far
        self._in_call = False
        self._failed = False
        self.calls: list[ToolCall] = []
        self.cut = False
        """The output ended inside a call's arguments after they began to stream."""
        self._started: CallStart | None = None
        self._args_from = 0  # where, in the block, the streamed call's arguments start
        self._args_sent = 0  # how many characters of them were released
        self._value = _ValueEnd()
        self._header_failed = False

    def feed(self, text: str) -> Iterator[Event]:
        self._pending += text
        while self._pending:
            if self._failed:
                yield from self._content_delta(self._pending)
                self._pending = ""
                return
            if not self._in_call:
                at = self._pending.find(CALL_OPEN)
                if at == -1:
                    keep = _partial_suffix(self._pending, CALL_OPEN)
                    yield from self._content_delta(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    return
                if not self.calls:
                    yield from self._content_delta(self._pending[:at])
                self._pending = self._pending[at + len(CALL_OPEN) :]
                self._in_call = True
            end = self._pending.find(CALL_CLOSE)
            if end == -1:
                yield from self._stream_arguments(self._pending, _partial_suffix(self._pending, CALL_CLOSE))
                return
            block = self._pending[:end]
            yield from self._stream_arguments(block, 0)
            yield from self._finish_call(block)
            self._pending = self._pending[end + len(CALL_CLOSE) :]
            self._in_call = False

    def close(self) -> Iterator[Event]:
        """At the end of the output: an unclosed call if it parses, else its text as content."""
        pending, self._pending = self._pending, ""
        if self._in_call and not self._failed:
            self._in_call = False
            yield from self._stream_arguments(pending, 0)
            yield from self._finish_call(pending, unclosed=True)
        elif not self.calls and self._started is None:
            yield from self._content_delta(pending)

    def _stream_arguments(self, block: str, hold: int) -> Iterator[Event]:
        """Release the arguments of the call in ``block`` that are known (``hold``: characters
        at the end that may be the start of the closing tag)."""
        if self._failed or self._header_failed:
            return
        if self._started is None:
            header = read_header(block)
            if header == NO:
                self._header_failed = True  # released whole when it closes
                return
            if isinstance(header, str):
                return
            name, self._args_from = header
            self._started = CallStart(len(self.calls), new_call_id(), name)
            yield self._started
        upto = len(block) - hold
        start = self._args_from + self._args_sent
        taken = 0
        for char in block[start:upto]:
            if not self._value.feed(char):
                break
            taken += 1
        if taken:
            self._args_sent += taken
            yield ArgumentsDelta(self._started.index, block[start : start + taken])

    def _finish_call(self, block: str, unclosed: bool = False) -> Iterator[Event]:
        started, self._started = self._started, None
        self._header_failed = False
        streamed = block[self._args_from : self._args_from + self._args_sent]
        value_done = self._value.done or (self._value.scalar and self._value.started)
        self._value, self._args_sent = _ValueEnd(), 0
        call = parse_call(block, started.id if started is not None else None)
        if started is not None:
            if call is None or call.arguments != streamed:
                # malformed after its header went out: the call ends as it was streamed
                call = ToolCall(started.id, started.name, streamed)
                self.cut = self.cut or (unclosed and not value_done)
            self.calls.append(call)
            yield call
            return
        if call is None:
            # not a call after all: from here on everything is content (calls already released stay)
            self._failed = True
            if not self.calls:
                yield from self._content_delta(CALL_OPEN + block + ("" if unclosed else CALL_CLOSE))
            return
        self.calls.append(call)
        yield call

    def _content_delta(self, text: str) -> Iterator[str]:
        if text and not self.calls:  # as in parse_calls: content is what comes before the calls
            yield text


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` are a proper prefix of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
