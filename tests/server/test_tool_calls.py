"""Tool calling through the API on the tiny model: tool_choice, streaming calls, the errors, and
KV reuse across an agent's tool loop (the history an agent resends tokenises as it was made)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from server_builders import MODEL_NAME, LiveServer, cached, live_server, tiny_model

from kvstrata.integrations.transformers.model import LoadedModel

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"enum": ["river", "lake", "sea"]}, "exact": {"type": "boolean"}},
            "required": ["word", "exact"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TOOLS = [LOOKUP, CLOCK]
USER = {"role": "user", "content": "What is a river? Look it up."}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model: LoadedModel = tiny_model(tmp_path_factory.mktemp("model"))
    with live_server(model, tmp_path_factory.mktemp("srv"), max_prompt_tokens=4000) as srv:
        yield srv


def create(server: LiveServer, messages: list[dict[str, Any]] | None = None, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 160)  # one byte per token: a call is about 80
    kw.setdefault("tools", TOOLS)
    return server.client().chat.completions.create(model=MODEL_NAME, messages=messages or [USER], **kw)


def check_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "lookup":
        assert arguments["word"] in ("river", "lake", "sea") and isinstance(arguments["exact"], bool)
    else:
        assert call.function.name == "clock" and arguments == {}
    return arguments  # type: ignore[no-any-return]


def test_required_gives_valid_calls_even_from_a_random_model(server: LiveServer) -> None:
    for seed in range(4):
        reply = create(server, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])
    # parallel calls: as many as the model writes (this one may go on to max_tokens: then the
    # cut last call is dropped), each valid
    several = create(server, tool_choice="required", temperature=1.0, seed=2, max_tokens=400)
    assert several.choices[0].message.tool_calls
    for call in several.choices[0].message.tool_calls:
        check_call(call)


def test_a_named_tool_choice_calls_that_function(server: LiveServer) -> None:
    named = {"type": "function", "function": {"name": "clock"}}
    calls = create(server, tool_choice=named, temperature=1.0, seed=1).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["clock"] and calls[0].function.arguments == "{}"


def test_none_and_auto_read_no_markup_as_calls(server: LiveServer) -> None:
    for choice in ("none", "auto"):
        reply = create(server, tool_choice=choice, max_tokens=8)
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"


def test_streamed_calls_equal_the_batch_ones(server: LiveServer) -> None:
    kw = {"tool_choice": "required", "temperature": 1.0, "seed": 4, "max_tokens": 400}
    batch = create(server, **kw).choices[0].message.tool_calls
    chunks = list(create(server, stream=True, **kw))
    streamed = assemble(chunks)
    assert [(i, name, arguments) for i, (_, name, arguments) in enumerate(streamed)] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(batch)
    ]
    assert all(call_id.startswith("call_") for call_id, _, _ in streamed)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def assemble(chunks: list[Any]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each streamed call, put together as OpenAI's clients do: the id
    and name in a call's first delta, its arguments over the deltas after it."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.id is not None:
                assert delta.index not in calls and delta.function.name
                calls[delta.index] = [delta.id, delta.function.name, delta.function.arguments or ""]
            else:
                assert delta.function.name is None
                calls[delta.index][2] += delta.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [(c[0], c[1], c[2]) for _, c in sorted(calls.items())]


def test_streamed_arguments_arrive_before_the_call_is_complete(server: LiveServer) -> None:
    """Issue 31, acceptance 4: the arguments stream as the model writes them."""
    chunks = list(
        create(server, stream=True, tool_choice={"type": "function", "function": {"name": "lookup"}})
    )
    argument_chunks = [
        c.choices[0].delta.tool_calls[0].function.arguments
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls and c.choices[0].delta.tool_calls[0].id is None
    ]
    ((_, name, arguments),) = assemble(chunks)
    assert name == "lookup" and json.loads(arguments)
    assert len(argument_chunks) > 3 and argument_chunks[0] != arguments  # not whole in one chunk
    assert "".join(argument_chunks) == arguments


def test_required_parallel_calls_are_never_cut(server: LiveServer) -> None:
    """Issue 31, acceptance 4: with parallel calls allowed, a reply ends after a complete call
    rather than stopping inside the next one at max_tokens; each call it has parses, streamed or not."""
    # a seed with which the model goes on to a second call
    seed = next(
        s
        for s in range(16)
        if len(
            create(server, tool_choice="required", max_tokens=600, temperature=1.0, seed=s)
            .choices[0]
            .message.tool_calls
        )
        > 1
    )
    kw = {"tool_choice": "required", "temperature": 1.0, "seed": seed}
    # the first call alone (the same tokens: the grammar allows the same ones up to its end)
    used = create(server, max_tokens=400, parallel_tool_calls=False, **kw).usage.completion_tokens
    reply = create(server, max_tokens=used + 8, **kw).choices[0]  # room for part of a second call
    assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1
    check_call(reply.message.tool_calls[0])
    chunks = list(create(server, max_tokens=used + 8, stream=True, **kw))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    call = reply.message.tool_calls[0]
    assert [(n, a) for _, n, a in assemble(chunks)] == [(call.function.name, call.function.arguments)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "delete_all"}}},
            "tool_choice names the function 'delete_all', which is not among the tools (lookup, clock)",
        ),
        ({"tools": [{"type": "web_search"}]}, "tool type 'web_search' is not supported"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": [LOOKUP, LOOKUP]}, "function names must be unique"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
        (
            {
                "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            },
            "invalid grammar",
        ),
        (
            {"messages": [USER, {"role": "tool", "tool_call_id": "call_x", "content": "42"}]},
            "tool_call_id 'call_x' does not answer a tool call of an earlier assistant message",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only assistant messages"),
    ],
)
def test_unknown_tools_and_bad_tool_messages_are_clear_400s(
    server: LiveServer, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(server, **kwargs)
    assert message in info.value.body["message"]  # type: ignore[index]


def test_each_step_of_a_tool_loop_reuses_the_previous_one(server: LiveServer) -> None:
    """An agent resends its whole history each step: assistant call, tool result, next call. The
    byte-level tokenizer tokenises a text one way only, so the re-rendered call must be the
    very tokens generated: the whole previous step (prompt and call) is reused."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You look things up."}, USER]
    session = {"X-Session-Id": "tool-loop"}
    previous = None
    for step in range(3):
        reply = create(
            server,
            messages,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=step,
            extra_headers=session,
        )
        if previous is not None:
            # everything but the last generated token (its KV was never computed) is reused
            assert cached(reply) == previous.usage.prompt_tokens + previous.usage.completion_tokens - 1
        call = reply.choices[0].message.tool_calls[0]
        # as frameworks send it back: content None, the call's id, name and arguments as received
        messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {step}"})
        previous = reply
    stateless = create(server, messages, tool_choice="none", max_tokens=2)  # shared blocks only
    assert cached(stateless) >= 0.9 * previous.usage.prompt_tokens
