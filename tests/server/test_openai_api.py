"""The OpenAI-compatible routes, driven by the official client against a live server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_builders import BLOCK_TOKENS, MODEL_NAME, LiveServer, cached, chat, live_server, tiny_model

from kvstrata.integrations.transformers.model import LoadedModel
from kvstrata.server import ServerConfig

SYSTEM = {"role": "system", "content": "You are a careful agent that keeps long notes."}
MAX_PROMPT_TOKENS = 200


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(model, tmp_path_factory.mktemp("srv"), max_prompt_tokens=MAX_PROMPT_TOKENS) as srv:
        yield srv


def store_state(srv: LiveServer) -> tuple[list[str], int]:
    srv.store.flush()
    return sorted(s.id for s in srv.store.list_sessions()), srv.store.disk.usage().blocks


def test_models_lists_the_served_model(server: LiveServer) -> None:
    assert [m.id for m in server.client().models.list()] == [MODEL_NAME]


def test_second_turn_reuses_the_sessions_cached_prefix(server: LiveServer) -> None:
    client = server.client()
    messages = [SYSTEM, {"role": "user", "content": "Plan the trip."}]
    first = chat(client, messages, "trip")
    assert cached(first) == 0
    assert first.usage.completion_tokens == 6
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now book it."},
    ]
    second = chat(client, messages, "trip")
    assert first.usage.prompt_tokens <= cached(second) < second.usage.prompt_tokens
    assert server.store.session("trip").num_tokens == second.usage.prompt_tokens + 5


def test_streamed_turn_reuses_the_prefix_and_reports_usage(server: LiveServer) -> None:
    client = server.client()
    messages = [SYSTEM, {"role": "user", "content": "Stream me a story."}]
    first = chat(client, messages, "story")
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Continue."},
    ]
    chunks = list(chat(client, messages, "story", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[1:-1]][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert first.usage.prompt_tokens <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    # the streamed text is the text a non-streamed request gives (greedy decoding)
    text = "".join(c.choices[0].delta.content or "" for c in chunks[1:-1])
    server.store.delete_session("story-copy")
    server.store.fork(server.store.session("story"), "story-copy")
    assert text == chat(client, messages, "story-copy").choices[0].message.content


def test_stream_is_server_sent_events_ending_with_done(server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "messages": [SYSTEM], "max_tokens": 3, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_completions_continue_a_session(server: LiveServer) -> None:
    client = server.client()
    prompt = "Once upon a time there was a very long prompt about caches and tiers"
    first = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, extra_headers={"X-Session-Id": "tale"}
    )
    assert first.object == "text_completion" and first.usage.completion_tokens == 4
    second = client.completions.create(
        model=MODEL_NAME, prompt=prompt + " and more", max_tokens=4, extra_headers={"X-Session-Id": "tale"}
    )
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    streamed = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=4,
            stream=True,
            extra_headers={"X-Session-Id": "tale2"},
        )
    )
    assert streamed[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in streamed) == first.choices[0].text


def test_session_id_from_metadata(server: LiveServer) -> None:
    chat(server.client(), [SYSTEM], metadata={"session_id": "by-metadata"})
    assert server.store.session("by-metadata").num_tokens > 0


def test_stateless_requests_leave_no_session_but_share_full_blocks(server: LiveServer) -> None:
    client = server.client()
    messages = [SYSTEM, {"role": "user", "content": "A stateless question."}]
    before = store_state(server)[0]
    chat(client, messages)
    second = chat(client, messages)
    assert store_state(server)[0] == before
    assert cached(second) == (second.usage.prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def test_a_stateless_requests_session_is_transient(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stateless request's session is created transient (its newest blocks go to L3 in their
    ladder codec at once: it is deleted a moment later); a named session is not."""
    from kvstrata import KVStore

    created: list[tuple[str, bool]] = []
    create = KVStore.create_session

    def recording(self: KVStore, session_id: str, *args: object, **kwargs: object) -> object:
        created.append((session_id, bool(kwargs.get("transient"))))
        return create(self, session_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(KVStore, "create_session", recording)
    client = server.client()
    chat(client, [SYSTEM, {"role": "user", "content": "Stateless."}])
    chat(client, [SYSTEM, {"role": "user", "content": "Named."}], "named-one")
    assert [t for _, t in created] == [True, False]
    assert created[0][0].startswith("anon-") and created[1][0] == "named-one"


def test_priority_header_is_accepted(server: LiveServer) -> None:
    reply = chat(server.client(), [SYSTEM], "prio", headers={"X-Priority": "background"})
    assert reply.usage.completion_tokens == 6
    assert server.store.session("prio").priority.value == "background"


@pytest.mark.parametrize(
    ("kwargs", "status", "param", "code"),
    [
        ({"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"temperature": -1}, 400, "temperature", "invalid_value"),
        ({"n": 0}, 400, "n", "invalid_value"),
        ({"n": 17}, 400, "n", "invalid_value"),
        ({"top_p": 0}, 400, "top_p", "invalid_value"),
        ({"extra_body": {"prediction": {"type": "content"}}}, 400, "prediction", "unsupported_parameter"),
        ({"extra_headers": {"X-Priority": "urgent"}}, 400, "X-Priority", "invalid_value"),
        ({"extra_headers": {"X-Session-Id": "a/b"}}, 400, "X-Session-Id", "invalid_value"),
        ({"model": "gpt-4"}, 404, "model", "model_not_found"),
        (
            {"messages": [{"role": "user", "content": "word " * 300}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        ({"stream": True, "messages": [{"role": "user", "content": "word " * 300}]}, 400, "messages", None),
    ],
)
def test_invalid_requests_get_openai_errors_and_touch_nothing(
    server: LiveServer, kwargs: dict[str, object], status: int, param: str, code: str | None
) -> None:
    before = store_state(server)
    request = {
        "model": MODEL_NAME,
        "messages": [SYSTEM],
        "max_tokens": 4,
        "extra_headers": {"X-Session-Id": "rejected"},
    }
    request.update(kwargs)
    with pytest.raises(openai.APIStatusError) as info:
        server.client().chat.completions.create(**request)  # type: ignore[call-overload]
    assert info.value.status_code == status
    error = info.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert code is None or error["code"] == code
    assert store_state(server) == before


def test_malformed_json_is_a_400(server: LiveServer) -> None:
    with server.http() as http:
        response = http.post(
            "/v1/chat/completions",
            content=b'{"model": "tiny", ',
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_unknown_session_is_a_404_when_sessions_are_not_created_on_use(
    model: LoadedModel, tmp_path: Path
) -> None:
    with live_server(model, tmp_path, create_sessions=False) as srv:
        client = srv.client()
        with pytest.raises(openai.NotFoundError) as info:
            chat(client, [SYSTEM], "nobody")
        assert info.value.body["code"] == "session_not_found"  # type: ignore[index]
        assert srv.store.list_sessions() == []
        with srv.http() as http:
            assert http.post("/v1/sessions", json={"id": "nobody"}).status_code == 201
        assert chat(client, [SYSTEM], "nobody").usage.completion_tokens == 6


def test_a_client_leaving_a_stream_frees_the_engine(server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "messages": [SYSTEM], "max_tokens": 400, "stream": True}
    headers = {"X-Session-Id": "left"}
    with server.http() as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            first = next(response.iter_lines())
        assert first.startswith("data: ")
    # the abandoned request stops at its next token and releases the engine for this one
    assert chat(server.client(), [SYSTEM], "after-leaving").usage.completion_tokens == 6
    assert server.store.session("left").num_tokens < 100  # nothing of the 400 tokens persisted


def test_the_model_may_be_named_as_clients_name_it(server: LiveServer) -> None:
    """The README's client asks for "SmolLM2-135M-Instruct"; the server serves the GGUF's
    "SmolLM2-135M-Instruct.Q4_1". Hugging Face ids carry an organisation ("org/name")."""
    # not SYSTEM: other tests expect its prefix blocks to be stored by them first
    question = [{"role": "user", "content": "Which model are you?"}]
    assert chat(server.client(), question, model=f"some-org/{MODEL_NAME}").usage.completion_tokens == 6
    served = ServerConfig(model_name="SmolLM2-135M-Instruct.Q4_1")
    for name in (
        "SmolLM2-135M-Instruct.Q4_1",
        "SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ):
        assert served.serves(name), name
    for name in ("SmolLM2-360M-Instruct", "SmolLM2", "gpt-4", "SmolLM2-135M-Instruct.Q8_0"):
        assert not served.serves(name), name
