"""The fields frameworks send by default that were refused before (issue 31, gap 2): each is
answered 200 and does what docs/agents.md says, against a live server on the tiny model. Also the
request checks vLLM makes (``stream_options`` needs ``stream``; a JSON schema's objects are closed
unless they say otherwise), the tokenizer routes, and the router's own 404 and 405 bodies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from server_builders import MODEL_NAME, LiveServer, live_server, tiny_model

from kvstrata.integrations.transformers.tiny_tokenizer import CHATML_TEMPLATE
from kvstrata.priority import Priority
from kvstrata.server.jobs import namespace_for

USER = {"role": "user", "content": "Tell me about the river and the lakes."}
# the tiny model's template, reading one keyword of its own (for chat_template_kwargs)
TEMPLATE = (
    "{% if note is defined %}{{ '<|im_start|>system\\n' + note + '<|im_end|>\\n' }}{% endif %}"
    + CHATML_TEMPLATE
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("fields")
    model = tiny_model(root)
    model.tokenizer.chat_template = TEMPLATE
    with live_server(model, root) as srv:
        yield srv


def create(server: LiveServer, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 6)
    kw.setdefault("messages", [USER])
    return server.client().chat.completions.with_raw_response.create(
        model=MODEL_NAME, extra_headers=headers, **kw
    )


def body(raw: Any) -> Any:
    return raw.parse()


def test_prompt_cache_key_names_the_session(server: LiveServer) -> None:
    first = create(server, prompt_cache_key="pck-1")
    assert first.headers["X-Session-Id"] == "pck-1" and server.store.session("pck-1").num_tokens > 0
    again = body(create(server, prompt_cache_key="pck-1"))
    assert again.usage.prompt_tokens_details.cached_tokens >= body(first).usage.prompt_tokens - 1
    # a session header wins over the key
    assert (
        create(server, headers={"X-Session-Id": "hdr-1"}, prompt_cache_key="pck-2").headers["X-Session-Id"]
        == "hdr-1"
    )
    assert all(s.id != "pck-2" for s in server.store.list_sessions())


def test_cache_salt_keeps_kv_apart(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "A prompt long enough to fill several blocks of the store " * 2}]
    create(server, messages=messages, extra_body={"cache_salt": "alice"})
    same = body(create(server, messages=messages, extra_body={"cache_salt": "alice"}))
    other = body(create(server, messages=messages, extra_body={"cache_salt": "bob"}))
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # never another salt's blocks
    create(server, headers={"X-Session-Id": "salted"}, extra_body={"cache_salt": "alice"})
    assert [s.id for s in server.store.list_sessions(namespace_for("default", "alice"))] == ["salted"]
    assert all(s.id != "salted" for s in server.store.list_sessions("default"))


def test_chat_store_and_reasoning_effort_are_accepted_and_change_nothing(server: LiveServer) -> None:
    before = {s.id for s in server.store.list_sessions()}
    plain = body(create(server)).choices[0].message.content
    both = body(create(server, store=True, reasoning_effort="high", extra_body={"safety_identifier": "u-1"}))
    assert both.choices[0].message.content == plain
    assert {s.id for s in server.store.list_sessions()} == before  # nothing kept for them


@pytest.mark.parametrize(
    ("tier", "header", "priority"),
    [
        ("flex", None, Priority.BACKGROUND),
        ("priority", None, Priority.REALTIME),
        ("default", None, Priority.INTERACTIVE),
        ("flex", "realtime", Priority.REALTIME),
    ],
)
def test_service_tier_picks_the_priority_class(
    server: LiveServer, tier: str, header: str | None, priority: Priority
) -> None:
    session = f"tier-{tier}-{header}"
    headers = {"X-Session-Id": session, **({"X-Priority": header} if header else {})}
    create(server, headers=headers, service_tier=tier)
    assert server.store.session(session).priority is priority


def test_top_k_one_samples_the_greedy_token(server: LiveServer) -> None:
    greedy = body(create(server, max_tokens=8)).choices[0].message.content
    for seed in (1, 2):
        sampled = body(create(server, max_tokens=8, temperature=1.5, seed=seed, extra_body={"top_k": 1}))
        assert sampled.choices[0].message.content == greedy
    wide = body(create(server, max_tokens=8, temperature=1.5, seed=1, extra_body={"top_k": -1}))
    assert wide.choices[0].message.content != greedy  # -1: all tokens, as in vLLM


def _generated_ids(server: LiveServer, prompt: list[int], **extra: Any) -> list[int]:
    reply = server.client().completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=8,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra},
    )
    tokens = reply.choices[0].logprobs.tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_repetition_penalty_keeps_prompt_and_output_tokens_out(server: LiveServer) -> None:
    prompt = [70, 71, 72, 73, 74, 75]
    plain = _generated_ids(server, prompt)
    penalised = _generated_ids(server, prompt, repetition_penalty=1e6)
    assert penalised != plain
    assert len(set(penalised)) == len(penalised) and not set(penalised) & set(prompt)


def test_logit_bias_is_applied(server: LiveServer) -> None:
    assert _generated_ids(server, [70, 71, 72], logit_bias={"88": 100}) == [88] * 8
    plain = _generated_ids(server, [70, 71, 72])
    banned = _generated_ids(server, [70, 71, 72], logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]


def test_chat_template_kwargs_reach_the_template(server: LiveServer) -> None:
    plain = body(create(server)).usage.prompt_tokens
    noted = body(
        create(server, extra_body={"chat_template_kwargs": {"note": "Be terse."}})
    ).usage.prompt_tokens
    # the note's bytes, one token each, and <|im_start|> and <|im_end|>, one token each
    assert noted == plain + len("system\nBe terse.\n") + 2
    with pytest.raises(openai.BadRequestError) as info:
        create(server, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


def test_echo_starts_the_text_with_the_prompt(server: LiveServer) -> None:
    client = server.client()
    plain = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=5)
    echoed = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=5, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    chunks = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=5, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=2, echo=True, logprobs=1)
    assert info.value.body["param"] == "echo"  # type: ignore[index]


def test_stream_options_without_stream_is_a_400(server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(server, stream_options={"include_usage": True})
    assert info.value.body["param"] == "stream_options"  # type: ignore[index]


def test_json_schema_objects_are_closed_unless_they_say_otherwise(server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    for seed in range(3):  # the random model, sampling: an open object would get keys of its own
        reply = body(create(server, max_tokens=64, temperature=1.0, seed=seed, response_format=fmt))
        assert set(json.loads(reply.choices[0].message.content)) == {"a"}


def test_tokenize_and_detokenize_in_vllms_shapes(server: LiveServer) -> None:
    with server.http() as http:
        text = http.post("/tokenize", json={"prompt": "Hello", "return_token_strs": True}).json()
        assert text["count"] == len(text["tokens"]) == len(text["token_strs"]) and text["max_model_len"] > 0
        assert http.post("/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": "Hello"}
        chat = http.post("/tokenize", json={"model": MODEL_NAME, "messages": [USER]}).json()
        assert chat["count"] == body(create(server)).usage.prompt_tokens  # what a chat request sends
        bad = http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_unknown_routes_and_methods_get_openai_error_bodies(server: LiveServer) -> None:
    with server.http() as http:
        missing = http.get("/v1/nope")
        assert missing.status_code == 404
        assert missing.json()["error"] == {
            "message": "no such route: GET /v1/nope",
            "type": "not_found_error",
            "param": None,
            "code": "not_found",
        }
        wrong = http.delete("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
        assert "POST" in wrong.json()["error"]["message"] and wrong.headers["Allow"] == "POST"
