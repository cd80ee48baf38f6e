"""Turning a request's generated tokens into text, and stop strings that end it.

:class:`IncrementalText` decodes one token at a time (windowed, as vLLM and TGI do, so a long
output is not decoded again at every token) and never releases a partial UTF-8 character.
:class:`StopStrings` finds the first stop string in the text and says how much of the text's end
must be held back because it could still become one: a streamed delta therefore never carries
text that a later token reveals to be (the start of) a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalText:
    """The text of a growing token sequence (special tokens skipped)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: tokens decoded again for context
        self._read_offset = 0  # tokens whose text is in ``text`` already
        self.text = ""

    def add(self, token: int) -> str:
        """Append ``token``; the text it completes ("" while a character is still partial)."""
        self._ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still withheld at the end (a trailing partial character, as the replacement char)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset :]
        before = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        after = decode(window, skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        delta = after[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


class StopStrings:
    """A request's stop strings."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, new_chars: int) -> tuple[int, str] | None:
        """The earliest stop string that ends within the last ``new_chars`` characters of
        ``text`` (the text before them was searched already): (where it starts, which one); None
        if there is none. Of two that start at the same place, the one listed first wins."""
        if not self.stops or new_chars <= 0:
            return None
        first_new = len(text) - new_chars
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = text.find(stop, max(0, first_new - len(stop) + 1))  # a match must end in the new text
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def holdback(self, text: str) -> int:
        """How many characters at the end of ``text`` could be the start of a stop string."""
        for length in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
