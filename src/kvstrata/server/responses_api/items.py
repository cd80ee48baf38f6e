"""Items: what a conversation of the Responses API is made of, as stored and as the model sees it.

A stored item is a plain dict in OpenAI's shape, with an ``id``: ``message`` (role and text
content parts), ``function_call`` (``call_id``, ``name``, ``arguments``) and
``function_call_output`` (``call_id``, ``output``). A conversation is a list of them, and it is
rendered to chat messages (:func:`chat_messages`) the same way every time it is sent again: an
assistant message and the function calls after it are one assistant turn (its text, then the
calls as the model wrote them), so a chain's next request renders its history as the very text
the model generated, and reuses the KV of it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from kvstrata.server.errors import APIError
from kvstrata.server.responses_api.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    parse_item,
)
from kvstrata.server.tools import ToolCall, parse_calls

Item = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def input_items(raw: str | list[Any] | None, history: Sequence[Item]) -> list[Item]:
    """The request's input as stored items (ids given to those without); a
    ``function_call_output`` must answer a call of ``history`` or of the input before it."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [_message("user", raw)]
    called = {item["call_id"] for item in history if item["type"] == "function_call"}
    items = []
    for index, value in enumerate(raw):
        parsed = parse_item(index, value)
        if parsed is None:
            continue
        if isinstance(parsed, FunctionCallItem):
            called.add(parsed.call_id)
        elif isinstance(parsed, FunctionCallOutputItem) and parsed.call_id not in called:
            raise APIError(
                400,
                f"input.{index}: no function call with call_id {parsed.call_id!r} precedes this "
                "function_call_output (in the input or the previous response)",
                param=f"input.{index}.call_id",
                code="invalid_value",
            )
        items.append(_stored(parsed))
    return items


def _stored(item: InputItem) -> Item:
    if isinstance(item, MessageItem):
        return _message(item.role, item.text(), item.id)
    if isinstance(item, FunctionCallItem):
        return function_call_item(ToolCall(item.call_id, item.name, item.arguments), item.id)
    return {
        "id": item.id or new_id("fco"),
        "type": "function_call_output",
        "call_id": item.call_id,
        "output": item.text(),
        "status": "completed",
    }


def _message(role: str, text: str, item_id: str | None = None) -> Item:
    part_type = "output_text" if role == "assistant" else "input_text"
    part: Item = {"type": part_type, "text": text}
    if role == "assistant":
        part["annotations"] = []
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [part],
    }


def message_text(item: Item) -> str:
    return "\n".join(str(p.get("text", "")) for p in item["content"])


def function_call_item(call: ToolCall, item_id: str | None = None, status: str = "completed") -> Item:
    return {
        "id": item_id or new_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }


def assistant_message(item_id: str, text: str, status: str, logprobs: list[Any] | None = None) -> Item:
    part: Item = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def output_items(text: str, *, reads_calls: bool, status: str) -> list[Item]:
    """The output items of a whole generated ``text``: its content as a message (when there is
    any, or when there are no calls), then its calls."""
    content: str | None = text
    calls: list[ToolCall] = []
    if reads_calls:
        content, calls = parse_calls(text)
    items: list[Item] = []
    if content or not calls:
        items.append(assistant_message(new_id("msg"), content or "", status))
    items += [function_call_item(call) for call in calls]
    return items


def chat_messages(instructions: str | None, items: Sequence[Item]) -> list[dict[str, Any]]:
    """The chat messages of a conversation (OpenAI's chat shape, for :mod:`kvstrata.server.chat`)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    assistant: dict[str, Any] | None = None  # the assistant turn being built
    for item in items:
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            assistant = None
            messages.append({"role": item["role"], "content": message_text(item)})
        elif kind == "message":
            if assistant is None or assistant.get("tool_calls"):
                assistant = {"role": "assistant", "content": ""}
                messages.append(assistant)
            text = message_text(item)
            assistant["content"] = f"{assistant['content']}\n{text}" if assistant["content"] else text
        elif kind == "function_call":
            if assistant is None:
                assistant = {"role": "assistant", "content": None}
                messages.append(assistant)
            call = {"name": item["name"], "arguments": item["arguments"]}
            assistant.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
        else:  # function_call_output
            assistant = None
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    for message in messages:
        if message["role"] == "assistant" and message["content"] == "" and message.get("tool_calls"):
            message["content"] = None
    return messages
