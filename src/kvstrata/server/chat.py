"""A chat request, made ready for the engine: the messages the chat template renders, the tools,
and what constrains the output (``tool_choice``, ``response_format``).

Roles: ``developer`` is rendered as ``system`` (OpenAI's newer name for it). Text content parts
are joined with newlines. When the request has tools and the model's chat template cannot render
them (SmolLM2's cannot), they are described in the system prompt and calls and results are
written in the Hermes format (:mod:`kvstrata.server.tools`); a template that renders tools gets
them, and the calls and results, through ``apply_chat_template(tools=...)``.

The rendering is a pure function of the request, the same every time an agent resends its
history: that is what lets each step of a tool loop reuse the KV of the step before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvstrata.engine.grammar import GrammarSpec
from kvstrata.server import tools as hermes
from kvstrata.server.errors import APIError
from kvstrata.server.schema_defaults import closed_objects
from kvstrata.server.schemas import ChatCompletionRequest, ChatMessage, ResponseFormat


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None
    """Tools for a template that renders them itself (else None: they are in the messages)."""
    reads_calls: bool
    """The output is read for tool calls (tools were given and ``tool_choice`` is not none)."""
    grammar: GrammarSpec | None
    whole_items: bool = False
    """The grammar is one of calls: decoding ends after a complete call rather than cut one."""


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def prepare_chat(body: ChatCompletionRequest, tokenizer: Any) -> ChatPrompt:
    """The request's prompt and constraint; :class:`APIError` (400) for an inconsistent one."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = _tool_choice(body, tools)
    _check_tool_results(body.messages)
    native = bool(tools) and template_renders_tools(tokenizer)
    if native:
        messages = [_native_message(m) for m in body.messages]
    else:
        messages = [_hermes_message(m) for m in body.messages]
        if tools:
            messages = _with_tool_prompt(messages, hermes.system_prompt(tools))
    answer = response_schema(body.response_format)
    grammar = None
    if choice == "required":
        grammar = hermes.call_grammar(tools, parallel=body.parallel_tool_calls)
    elif isinstance(choice, dict):  # one named function, called once
        grammar = hermes.call_grammar([choice], parallel=False)
    elif choice == "auto" and answer is not None:
        grammar = hermes.call_grammar(tools, parallel=body.parallel_tool_calls, or_json=answer)
    elif answer is not None:
        grammar = GrammarSpec.json_schema(answer)
    calls = choice == "required" or isinstance(choice, dict) or (choice == "auto" and answer is not None)
    return ChatPrompt(messages, tools if native else None, bool(tools) and choice != "none", grammar, calls)


def response_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema the output must satisfy, or None for free text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    assert response_format.json_schema is not None  # checked by the schema
    return closed_objects(response_format.json_schema.json_schema or {"type": "object"})


def _tool_choice(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    """ "none", "auto", "required", or the named tool."""
    choice = body.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return "none"
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools", code="invalid_value")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    name = choice.function.name
    if name not in names:
        raise APIError(
            400,
            f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(names)})",
            param="tool_choice",
            code="invalid_value",
        )
    return tools[names.index(name)]


def _check_tool_results(messages: list[ChatMessage]) -> None:
    """Each tool message answers a call of an earlier assistant message (as OpenAI requires)."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        for call in message.tool_calls or []:
            called.add(call.id)
        if message.role == "tool" and message.tool_call_id not in called:
            raise APIError(
                400,
                f"messages.{index}: tool_call_id {message.tool_call_id!r} does not answer a tool call "
                "of an earlier assistant message",
                param=f"messages.{index}.tool_call_id",
                code="invalid_value",
            )


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def _hermes_message(message: ChatMessage) -> dict[str, Any]:
    text = message.text()
    if message.role == "tool":
        return {"role": "tool", "content": hermes.render_result(text)}
    if message.tool_calls:
        calls = hermes.render_calls([call.model_dump() for call in message.tool_calls])
        text = f"{text}\n{calls}" if text else calls
    return {"role": _role(message), "content": text}


def _native_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": _role(message), "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _arguments(text: str) -> Any:
    """Arguments as templates expect them (a mapping), when they are a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _with_tool_prompt(messages: list[dict[str, Any]], tool_prompt: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        system = {"role": "system", "content": f"{first}\n\n{tool_prompt}" if first else tool_prompt}
        return [system, *messages[1:]]
    return [{"role": "system", "content": tool_prompt}, *messages]
