"""The Hermes tool format: rendering, the call grammar, and reading calls back (whole or streamed)."""

from __future__ import annotations

import json

import pytest

from kvstrata.engine.grammar import GrammarCompiler
from kvstrata.integrations.transformers.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer
from kvstrata.server.call_stream import ArgumentsDelta, CallStart, CallStream
from kvstrata.server.tools import ToolCall, call_grammar, parse_calls, render_calls, system_prompt

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"],
            "additionalProperties": False,
            "$defs": {"City": {"type": "string", "maxLength": 12}},
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
TOKENIZER = tiny_tokenizer()


def call(name: str, arguments: str) -> dict[str, object]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, TINY_VOCAB_SIZE, 2)


def accepts(grammars: GrammarCompiler, spec: object, text: str) -> bool:
    constraint = grammars.constraint(spec)  # type: ignore[arg-type]
    try:
        for token in TOKENIZER.encode(text, add_special_tokens=False):
            if not bool(constraint.allowed()[token]):
                return False
            constraint.consume(token)
    except Exception:
        return False
    return constraint.accepting


def test_a_rendered_call_parses_back_to_the_same_text() -> None:
    arguments = '{"city": "Paris", "units": ["c", "f"]}'
    text = render_calls([call("get_weather", arguments)])
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + "}\n</tool_call>"
    content, calls = parse_calls(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", arguments)]
    # the arguments' text is kept as written (not re-serialised), so it renders back the same
    odd = '{"city":"Paris" ,"n": 1.50}'
    rendered = render_calls([call("f", odd)])
    assert parse_calls(rendered)[1][0].arguments == odd
    assert render_calls([call("f", parse_calls(rendered)[1][0].arguments)]) == rendered


def test_parse_reads_content_several_calls_and_refuses_non_calls() -> None:
    two = render_calls([call("a", "{}"), call("b", '{"x": 1}')])
    content, calls = parse_calls("Let me check.\n" + two)
    assert content == "Let me check.\n" and [c.name for c in calls] == ["a", "b"]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_calls(broken) == (broken, [])
    # a last block cut by max_tokens after complete calls is dropped; the calls stay
    content, calls = parse_calls(render_calls([call("a", "{}")]) + '\n<tool_call>\n{"name": "b", "argu')
    assert [c.name for c in calls] == ["a"]
    # "parameters" (some models' name for it) and an unclosed but complete last call are read
    assert parse_calls('<tool_call>{"name": "a", "parameters": {"k": 2}}')[1][0].arguments == '{"k": 2}'


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 1000])
def test_streamed_calls_equal_the_parsed_ones_whatever_the_chunking(chunk: int) -> None:
    text = "Checking <tool" + "\n" + render_calls([call("a", '{"q": "<tool_call>?"}'), call("b", "{}")])
    stream = CallStream()
    items: list[str | ToolCall] = []
    for start in range(0, len(text), chunk):
        items += stream.feed(text[start : start + chunk])
    items += stream.close()
    content, calls = parse_calls(text)
    streamed = [i for i in items if isinstance(i, ToolCall)]
    assert "".join(i for i in items if isinstance(i, str)) == content
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    # no content delta ever carried a piece of the call markup
    assert all("<tool_call" not in i for i in items if isinstance(i, str))


def test_streamed_text_without_calls_is_all_content() -> None:
    stream = CallStream()
    items = [*stream.feed("a <tool"), *stream.feed("box> b"), *stream.close()]
    assert "".join(items) == "a <toolbox> b"  # type: ignore[arg-type]
    broken = CallStream()
    items = [*broken.feed("<tool_call>\n{oops"), *broken.close()]
    assert items == ["<tool_call>\n{oops"]


def test_the_system_prompt_lists_tools_in_a_fixed_form() -> None:
    prompt = system_prompt([WEATHER, CLOCK])
    assert prompt == system_prompt([WEATHER, CLOCK])
    lines = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in lines] == ["get_weather", "get_time"]
    assert "<tool_call>" in prompt


def test_the_call_grammar_takes_exactly_valid_calls(grammars: GrammarCompiler) -> None:
    spec = call_grammar([WEATHER, CLOCK])
    weather = render_calls([call("get_weather", '{"city": "Paris"}')])
    clock = render_calls([call("get_time", "{}")])
    assert accepts(grammars, spec, weather)
    assert accepts(grammars, spec, weather + "\n" + clock)  # parallel calls
    assert not accepts(grammars, call_grammar([WEATHER, CLOCK], parallel=False), weather + "\n" + clock)
    too_long = '{"city": "Paris, France, Europe"}'  # maxLength 12, through the $ref
    assert not accepts(grammars, spec, render_calls([call("get_weather", too_long)]))
    assert not accepts(grammars, spec, render_calls([call("get_weather", "{}")]))  # city is required
    assert not accepts(grammars, spec, render_calls([call("delete_all", "{}")]))  # not a tool
    assert not accepts(grammars, spec, "Sure! " + weather)  # a call, nothing else
    either = call_grammar([CLOCK], or_json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert accepts(grammars, either, '{"a": 3}') and accepts(grammars, either, clock)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_arguments_stream_as_they_come_whatever_the_chunking(chunk: int) -> None:
    args = '{"q": "a }\\" <tool_call> </tool_call", "n": [1, {"x": 2}]}'
    text = "Let me see. " + render_calls([call("a", args), call("b", "{}")])
    stream = CallStream()
    items: list[object] = []
    for start in range(0, len(text), chunk):
        items += stream.feed(text[start : start + chunk])
    items += stream.close()
    starts = [i for i in items if isinstance(i, CallStart)]
    ends = [i for i in items if isinstance(i, ToolCall)]
    assert [(s.index, s.name) for s in starts] == [(0, "a"), (1, "b")]
    assert [e.id for e in ends] == [s.id for s in starts]  # the id the start announced
    for start, end in zip(starts, ends, strict=True):
        deltas = [i.text for i in items if isinstance(i, ArgumentsDelta) and i.index == start.index]
        assert "".join(deltas) == end.arguments
        # every delta went out before the call's end
        assert items.index(end) > max(
            i for i, x in enumerate(items) if isinstance(x, ArgumentsDelta) and x.index == start.index
        )
    assert [(c.name, c.arguments) for c in ends] == [(c.name, c.arguments) for c in parse_calls(text)[1]]
    if chunk == 1:  # byte by byte: the arguments came in many pieces, the first long before the end
        assert len([i for i in items if isinstance(i, ArgumentsDelta) and i.index == 0]) > 10


def test_calls_in_another_form_are_released_whole() -> None:
    stream = CallStream()
    text = '<tool_call>\n{"arguments": {"k": 1}, "name": "f"}\n</tool_call>'
    items = [*stream.feed(text), *stream.close()]
    assert len(items) == 1 and isinstance(items[0], ToolCall) and items[0].arguments == '{"k": 1}'


def test_a_call_cut_inside_its_arguments_ends_as_streamed() -> None:
    stream = CallStream()
    items = [*stream.feed('<tool_call>\n{"name": "f", "arguments": {"k": "ab'), *stream.close()]
    assert isinstance(items[0], CallStart) and stream.cut
    assert isinstance(items[-1], ToolCall) and items[-1].arguments == '{"k": "ab'
