"""Every field of the chat and text completion requests, against a live server on the tiny model:
content parts, roles, stop (batch and streaming), n, seed, top_p, logprobs, ignore_eos,
min_tokens, stop_token_ids, response_format, and the errors for what is not served."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from server_builders import MODEL_NAME, LiveServer, live_server, tiny_model

from kvstrata.engine import GenerationRequest
from kvstrata.integrations.transformers.model import LoadedModel

USER = {"role": "user", "content": "Tell me about the river and the lakes."}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(model, tmp_path_factory.mktemp("srv")) as srv:
        yield srv


def create(server: LiveServer, messages: list[dict[str, Any]] | None = None, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 12)
    return server.client().chat.completions.create(model=MODEL_NAME, messages=messages or [USER], **kw)


def streamed(server: LiveServer, **kw: Any) -> list[Any]:
    return list(create(server, stream=True, **kw))


def refused(server: LiveServer, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        create(server, **kw)
    body = info.value.body
    assert isinstance(body, dict)
    return body


def test_text_parts_are_the_same_as_a_string(server: LiveServer) -> None:
    plain = create(server).choices[0].message.content
    parts = [{"type": "text", "text": "Tell me about the river"}, {"type": "text", "text": "and the lakes."}]
    joined = create(server, [{"role": "user", "content": "Tell me about the river\nand the lakes."}])
    assert create(server, [{"role": "user", "content": parts}]).choices[0].message.content == (
        joined.choices[0].message.content
    )
    assert plain  # (the tiny model writes something)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
    ],
)
def test_other_content_parts_are_refused_clearly(server: LiveServer, part: dict[str, Any]) -> None:
    error = refused(server, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert error["message"] == (
        f"messages.0.content: content part 1 has type {part['type']!r}, which is not supported: the "
        "model served here reads text only (parts of type 'text')"
    )
    assert error["param"] == "messages.0.content"


def test_developer_is_rendered_as_system(server: LiveServer) -> None:
    as_system = create(server, [{"role": "system", "content": "Be brief."}, USER])
    as_developer = create(server, [{"role": "developer", "content": "Be brief."}, USER])
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens


def test_stop_ends_the_text_exactly_before_the_stop_string(server: LiveServer) -> None:
    full = create(server, max_tokens=16).choices[0].message.content
    stop = full[5:7]
    expected = full[: full.find(stop)]
    reply = create(server, max_tokens=16, stop=[stop, "\u2603never"])
    choice = reply.choices[0]
    assert choice.message.content == expected and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    chunks = streamed(server, max_tokens=16, stop=stop)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == expected
    assert not any(stop in d for d in deltas) and chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that never appears changes nothing
    assert create(server, max_tokens=16, stop="\u2603").choices[0].message.content == full


def test_n_choices_with_seeds(server: LiveServer) -> None:
    reply = create(server, n=3, temperature=1.0, seed=11, max_tokens=8, extra_body={"ignore_eos": True})
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert reply.usage.completion_tokens == 24
    # the choices of a seeded request repeat; greedy choices are all the same
    again = create(server, n=3, temperature=1.0, seed=11, max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == texts
    assert len({c.message.content for c in create(server, n=2, max_tokens=8).choices}) == 1
    chunks = streamed(server, n=2, temperature=1.0, seed=11, max_tokens=8, extra_body={"ignore_eos": True})
    by_choice: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            by_choice[c.index] += c.delta.content or ""
    assert [by_choice[0], by_choice[1]] == texts[:2]


def test_the_same_seed_gives_the_same_text(server: LiveServer) -> None:
    def sample(seed: int) -> str:
        return create(server, temperature=1.2, seed=seed, max_tokens=16).choices[0].message.content

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_a_tiny_top_p_is_greedy(server: LiveServer) -> None:
    greedy = create(server).choices[0].message.content
    assert create(server, temperature=1.5, top_p=1e-6, seed=1).choices[0].message.content == greedy
    penalised = create(server, presence_penalty=2.0, frequency_penalty=2.0, max_tokens=24)
    assert penalised.choices[0].message.content  # accepted and applied (see tests/engine)


def test_logprobs_equal_a_direct_forward(server: LiveServer, model: LoadedModel) -> None:
    reply = create(
        server,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_tokens_as_token_ids": True},
    )
    entries = reply.choices[0].logprobs.content
    generated = [int(e.token.removeprefix("token_id:")) for e in entries]
    prompt = server.engine.prompt_token_ids(GenerationRequest("x", messages=[USER]))
    with torch.inference_mode():
        logits = model.model(torch.tensor([prompt + generated])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    for position, (entry, token) in enumerate(zip(entries, generated, strict=True)):
        assert entry.logprob == pytest.approx(float(expected[position, token]), abs=1e-4)
        top = torch.topk(expected[position], 3)
        assert [t.token for t in entry.top_logprobs] == [f"token_id:{i}" for i in top.indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    # without the option, tokens are their text; streaming carries the same figures
    plain = create(server, temperature=1.0, seed=3, logprobs=True)
    assert [e.logprob for e in plain.choices[0].logprobs.content] == [e.logprob for e in entries]
    chunks = streamed(server, temperature=1.0, seed=3, logprobs=True)
    streamed_logprobs = [
        e.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert streamed_logprobs == [e.logprob for e in entries]
    assert create(server).choices[0].logprobs is None


def test_ignore_eos_min_tokens_and_stop_token_ids(server: LiveServer) -> None:
    assert create(server, max_tokens=20, extra_body={"ignore_eos": True}).usage.completion_tokens == 20
    first = create(server, max_tokens=20, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    token = int(first.choices[0].logprobs.content[0].token.removeprefix("token_id:"))
    stopped = create(server, max_tokens=20, extra_body={"stop_token_ids": [token]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].model_extra["stop_reason"] == token and stopped.choices[0].message.content == ""
    later = create(server, max_tokens=20, extra_body={"stop_token_ids": [token], "min_tokens": 4})
    assert later.usage.completion_tokens >= 5 or later.choices[0].finish_reason == "length"


def test_json_schema_output_is_valid_even_from_a_random_model(server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in range(5):
        reply = create(server, temperature=1.0, seed=seed, max_tokens=40, response_format=response_format)
        value = json.loads(reply.choices[0].message.content)
        assert set(value) == {"ok", "size"} and value["size"] in ("s", "m", "l")
        assert reply.choices[0].finish_reason == "stop"
    chunks = streamed(server, max_tokens=40, response_format=response_format)
    assert json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))["size"]


def test_a_bad_schema_is_a_clear_400(server: LiveServer) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    error = refused(server, response_format=bad)
    assert error["message"].startswith("invalid JSON schema") and "objectx" in error["message"]
    assert "json_schema" in refused(server, response_format={"type": "json_schema"})["message"]


def test_completions_take_the_same_fields(server: LiveServer) -> None:
    client = server.client()
    full = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=16)
    text = full.choices[0].text
    stop = text[4:6]
    reply = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=16, stop=stop, logprobs=2, n=2
    )
    assert [c.text for c in reply.choices] == [text[: text.find(stop)]] * 2
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == reply.usage.completion_tokens // 2
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    ids = server.engine.prompt_token_ids(GenerationRequest("x", prompt="Once upon a time"))
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=16)
    assert by_ids.choices[0].text == text
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    constrained = client.completions.create(
        model=MODEL_NAME, prompt="{", max_tokens=30, extra_body={"response_format": response_format}
    )
    assert json.loads(constrained.choices[0].text)["n"] in (1, 2)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=16, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text[: text.find(stop)]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"extra_body": {"min_tokens": 13}}, None),  # more than max_tokens
        ({"extra_body": {"stop_token_ids": [10**7]}}, "stop_token_ids"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"extra_body": {"logit_bias": {"5": 101}}}, "logit_bias"),
        ({"extra_body": {"logit_bias": {"x": 1}}}, "logit_bias"),
        ({"messages": [{"role": "critic", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0"),
    ],
)
def test_bad_field_values_are_refused(server: LiveServer, kwargs: dict[str, Any], param: str | None) -> None:
    assert refused(server, **kwargs)["param"] == param


def test_max_completion_tokens_and_user(server: LiveServer) -> None:
    reply = create(
        server, max_tokens=None, max_completion_tokens=3, user="agent-7", extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 3
    # max_completion_tokens wins over the older max_tokens, as in OpenAI's API
    both = create(server, max_tokens=9, max_completion_tokens=2, extra_body={"ignore_eos": True})
    assert both.usage.completion_tokens == 2
