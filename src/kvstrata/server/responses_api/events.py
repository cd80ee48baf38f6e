"""The streaming events of the Responses API, as OpenAI sends them and its clients (the ``openai``
package, the OpenAI Agents SDK) parse them: ``event: <type>`` and ``data: <json>`` lines, each
event with a ``sequence_number``.

The order: ``response.created``, ``response.in_progress``; for text, ``response.output_item.added``
(a message), ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
for each call, ``response.output_item.added`` (a function_call with empty arguments),
``response.function_call_arguments.delta``... as the model writes them,
``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` ended it) with the
whole response, which is stored before the event goes out.
"""

from __future__ import annotations

import json
from typing import Any

from kvstrata.engine.decoder import DecodeStep
from kvstrata.engine.engine import Response
from kvstrata.server import responses
from kvstrata.server.call_stream import ArgumentsDelta, CallStart, CallStream, Event
from kvstrata.server.responses_api.items import Item, assistant_message, function_call_item, new_id
from kvstrata.server.tools import ToolCall


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n"


class EventStream:
    """Turns one generation's steps into events, and keeps the output items they describe."""

    def __init__(self, *, reads_calls: bool, text_of: responses.TokenText | None) -> None:
        self._calls = CallStream() if reads_calls else None
        self._text_of = text_of
        self._sequence = 0
        self.output: list[Item] = []
        self._message: Item | None = None  # the message item being streamed
        self._text: list[str] = []
        self._logprobs: list[Any] = []  # of text held back, for the next delta
        self._all_logprobs: list[Any] = []
        self._call_items: dict[str, Item] = {}  # call id -> its function_call item, while streamed

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(body)

    def started(self, response: dict[str, Any]) -> list[str]:
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def step(self, step: DecodeStep) -> list[str]:
        logprobs = self._step_logprobs(step)
        events: list[Event] = list(self._calls.feed(step.text)) if self._calls is not None else [step.text]
        lines = []
        for item in events:
            lines += self._on(item, logprobs)
            logprobs = []
        self._logprobs += logprobs  # held-back text: its logprobs go with the next delta
        return lines

    def finish(self, response: Response, status: str) -> list[str]:
        """The events after the last step; :attr:`output` then holds the final items."""
        lines = []
        if self._calls is not None:
            for item in self._calls.close():
                lines += self._on(item, [])
        if self._message is not None:
            lines += self._close_message(status)
        elif not self.output:  # no text and no calls: an empty message, as the whole response has
            lines += self._open_message() + self._close_message(status)
        if self._calls is not None and self._calls.cut and self.output:
            self.output[-1]["status"] = "incomplete"
        return lines

    def _on(self, item: Event, logprobs: list[Any]) -> list[str]:
        if isinstance(item, str):
            if not item:
                return []
            lines = self._open_message() if self._message is None else []
            assert self._message is not None
            self._text.append(item)
            delta_logprobs, self._logprobs = [*self._logprobs, *logprobs], []
            return [
                *lines,
                self.event(
                    "response.output_text.delta", **self._where(), delta=item, logprobs=delta_logprobs
                ),
            ]
        lines = self._close_message("completed") if self._message is not None else []
        if isinstance(item, CallStart):
            call = function_call_item(ToolCall(item.id, item.name, ""), status="in_progress")
            self._call_items[item.id] = call
            self.output.append(call)
            return [
                *lines,
                self.event("response.output_item.added", output_index=len(self.output) - 1, item=call),
            ]
        if isinstance(item, ArgumentsDelta):
            call = self.output[-1]
            call["arguments"] += item.text
            where = {"item_id": call["id"], "output_index": len(self.output) - 1}
            return [*lines, self.event("response.function_call_arguments.delta", **where, delta=item.text)]
        streamed = self._call_items.pop(item.id, None)
        if streamed is None:  # released whole: its start and its arguments at once
            streamed = function_call_item(ToolCall(item.id, item.name, ""), status="in_progress")
            self.output.append(streamed)
            lines.append(
                self.event("response.output_item.added", output_index=len(self.output) - 1, item=streamed)
            )
            where = {"item_id": streamed["id"], "output_index": len(self.output) - 1}
            lines.append(self.event("response.function_call_arguments.delta", **where, delta=item.arguments))
        streamed.update(arguments=item.arguments, status="completed")
        index = self.output.index(streamed)
        where = {"item_id": streamed["id"], "output_index": index}
        return [
            *lines,
            self.event(
                "response.function_call_arguments.done", **where, name=item.name, arguments=item.arguments
            ),
            self.event("response.output_item.done", output_index=index, item=streamed),
        ]

    def _open_message(self) -> list[str]:
        self._message = assistant_message(new_id("msg"), "", "in_progress")
        self._message["content"] = []
        self.output.append(self._message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=self._message),
            self.event("response.content_part.added", **self._where(), part=part),
        ]

    def _close_message(self, status: str) -> list[str]:
        assert self._message is not None
        text = "".join(self._text)
        logprobs = self._all_logprobs if self._text_of is not None else None
        done = assistant_message(self._message["id"], text, status, logprobs)
        part = done["content"][0]
        where = self._where()
        self.output[self.output.index(self._message)] = done
        self._message, self._text = None, []
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=logprobs or []),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=where["output_index"], item=done),
        ]

    def _where(self) -> dict[str, Any]:
        assert self._message is not None
        return {
            "item_id": self._message["id"],
            "output_index": self.output.index(self._message),
            "content_index": 0,
        }

    def _step_logprobs(self, step: DecodeStep) -> list[Any]:
        if not step.logprobs or self._text_of is None:
            return []
        entries = responses.chat_logprobs(step.logprobs, self._text_of)["content"]
        self._all_logprobs += entries
        return list(entries)
