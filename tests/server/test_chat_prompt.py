"""How a chat request becomes the engine's messages and constraint (no model involved)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvstrata.engine.grammar import GrammarKind
from kvstrata.integrations.transformers.tiny_tokenizer import tiny_tokenizer
from kvstrata.server.chat import prepare_chat, template_renders_tools
from kvstrata.server.errors import APIError
from kvstrata.server.schemas import ChatCompletionRequest
from kvstrata.server.tools import system_prompt

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
HISTORY = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
]
# a ChatML template that renders tools itself, as tool-trained models' templates do
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def request(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, **body})


def test_without_template_support_tools_go_in_the_hermes_format() -> None:
    tokenizer = tiny_tokenizer()
    assert not template_renders_tools(tokenizer)
    chat = prepare_chat(request(tools=[TOOL]), tokenizer)
    assert chat.template_tools is None and chat.reads_calls and chat.grammar is None  # auto
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\n\n" + system_prompt([TOOL])},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'},
        {"role": "tool", "content": "<tool_response>\n42\n</tool_response>"},
    ]
    # without a system message the tool prompt is one; without tools nothing is added
    plain = prepare_chat(
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[TOOL]),
        tokenizer,
    )
    assert plain.messages[0] == {"role": "system", "content": system_prompt([TOOL])}
    assert prepare_chat(request(), tokenizer).messages[0] == {"role": "system", "content": "Be brief."}


def test_a_template_that_renders_tools_gets_them() -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = NATIVE_TEMPLATE
    assert template_renders_tools(tokenizer)
    chat = prepare_chat(request(tools=[TOOL], tool_choice="required"), tokenizer)
    assert chat.template_tools == [TOOL]
    assert chat.messages[2]["tool_calls"][0]["function"]["arguments"] == {
        "x": 1
    }  # a mapping, as templates expect
    assert chat.messages[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    text = tokenizer.apply_chat_template(chat.messages, tools=chat.template_tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nTOOLS [") and 'CALL f {"x": 1}' in text


def test_tool_choice_and_response_format_pick_the_constraint() -> None:
    tokenizer = tiny_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    json_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert (
        prepare_chat(request(response_format={"type": "json_object"}), tokenizer).grammar.kind
        is GrammarKind.JSON_SCHEMA
    )  # type: ignore[union-attr]
    required = prepare_chat(request(tools=[TOOL], tool_choice="required"), tokenizer).grammar
    assert (
        required is not None and required.kind is GrammarKind.LARK and 'call ("\\n" call)*' in required.source
    )
    single = prepare_chat(request(tools=[TOOL], tool_choice="required", parallel_tool_calls=False), tokenizer)
    assert single.grammar is not None and "start: call\n" in single.grammar.source
    either = prepare_chat(request(tools=[TOOL], response_format=json_schema), tokenizer).grammar
    assert (
        either is not None
        and "| answer" in either.source
        and json.dumps(schema["properties"]) in either.source
    )
    none = prepare_chat(request(tools=[TOOL], tool_choice="none", response_format=json_schema), tokenizer)
    assert not none.reads_calls and none.grammar is not None and none.grammar.kind is GrammarKind.JSON_SCHEMA
    assert "f" in none.messages[0]["content"]  # the tools stay in the prompt: the prefix is the same


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "auto"}, "tool_choice needs tools"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "not among the tools",
        ),
        ({"tools": [TOOL, TOOL]}, "must be unique"),
    ],
)
def test_inconsistent_tool_requests_are_refused(body: dict[str, Any], message: str) -> None:
    with pytest.raises(APIError, match=message):
        prepare_chat(request(**body), tiny_tokenizer())
