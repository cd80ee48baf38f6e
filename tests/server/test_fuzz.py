"""Schema-based fuzzing of the whole API (schemathesis, in-process over ASGI): no input gets a 5xx.

Every operation of the app's OpenAPI schema is fuzzed, with valid and invalid inputs; nothing is
excluded. ``POST /v1/sessions/import`` reads a raw body the schema does not describe, so only its
query is fuzzed here (tests/server/test_archive.py sends it bad archives). The server's limits are
small so that a generated request that reaches the engine stays fast on the tiny model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from server_builders import MODEL_NAME, open_store, tiny_model

from kvstrata.engine import Engine
from kvstrata.server import ServerConfig, create_app

EXAMPLES = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    root: Path = tmp_path_factory.mktemp("fuzz")
    model = tiny_model(root)
    with open_store(model, root / "store") as store:
        yield model, store


@pytest.fixture
def app(served: tuple[Any, Any]) -> Iterator[FastAPI]:
    # An engine per test: the app's lifespan (a `with TestClient`, schemathesis' calls) drains and
    # closes its engine when it ends, as `kvstrata serve` does on a stop; the store is shared.
    model, store = served
    engine = Engine(model, store)
    config = ServerConfig(
        model_name=MODEL_NAME, max_prompt_tokens=1500, max_tokens_limit=4, default_max_tokens=2
    )
    yield create_app(engine, config)
    engine.close()


def test_no_schema_input_gets_a_server_error(app: FastAPI) -> None:
    # schemathesis is not (yet) in the dev extras: a machine without it reports this test skipped
    schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis (4.x)")
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14  # every route of the app, none filtered out
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(operation.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                response = case.call()
                assert response.status_code < 500, (
                    case.method,
                    case.formatted_path,
                    case.body,
                    response.text,
                )

            try:
                check()
            except Unsatisfiable:
                # an operation without parameters or body (GET /healthz) has no invalid input
                assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
    with TestClient(app) as client:
        assert client.get("/healthz").json()["status"] == "ok"


# Random bodies rarely name the served model, so they stop at the model check: these reach the
# engine, with the model right and everything else fuzzed (the fields of issue 17 included).
_text = st.text(max_size=40)
_finite = st.floats(allow_nan=False, allow_infinity=False)  # JSON has no nan or infinity
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
# JSON schemas: real ones, broken ones, and random objects with schema keywords in them
_schema = st.one_of(
    st.just({"type": "object"}),
    st.just({"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}),
    st.just({"type": "objectx"}),
    st.just({"$ref": "#/$defs/missing"}),
    st.dictionaries(
        st.sampled_from(["type", "properties", "items", "enum", "required", "$ref", "anyOf", "x"]),
        _json,
        max_size=3,
    ),
)
_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "file", ""])}),
    _json,
)
_call = st.fixed_dictionaries(
    {
        "id": st.sampled_from(["c1", "c2"]),
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", ""]), "arguments": _text}),
    }
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", ""]),
        "content": st.one_of(_text, st.none(), st.lists(_part, max_size=2)),
    },
    optional={
        "name": st.one_of(st.none(), _text),
        "tool_calls": st.lists(_call, max_size=2),
        "tool_call_id": st.sampled_from(["c1", "c2", "nope"]),
    },
)
_tool = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "function", "web_search"]),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g", "bad name"])}, optional={"parameters": _schema}
        ),
    }
)
_response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries({"name": st.just("out")}, optional={"schema": _schema}),
        }
    ),
)
_params = {
    "max_tokens": st.one_of(st.none(), st.integers(-2, 6)),
    "temperature": st.one_of(_finite, st.integers(-1, 3)),
    "seed": st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "metadata": st.one_of(st.none(), st.dictionaries(st.sampled_from(["session_id", "x"]), _text)),
    "n": st.integers(0, 3),
    "stop": st.one_of(st.none(), _text, st.lists(_text, max_size=3)),
    "top_p": st.one_of(_finite, st.integers(-1, 2)),
    "presence_penalty": _finite,
    "frequency_penalty": _finite,
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(-1, 8),
    "stop_token_ids": st.lists(st.integers(-1, 10**6), max_size=3),
    "response_format": _response_format,
    "user": _text,
}
_chat_params = {
    **_params,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 22),
    "tools": st.lists(_tool, max_size=2),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required", "any"]),
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])}),
            }
        ),
    ),
    "parallel_tool_calls": st.booleans(),
    "max_completion_tokens": st.one_of(st.none(), st.integers(-1, 6)),
}
_completion_params = {**_params, "logprobs": st.one_of(st.none(), st.integers(-1, 6))}
_chat = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "messages": st.lists(_message, max_size=3)}, optional=_chat_params
)
_completion = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "prompt": st.one_of(_text, st.lists(st.integers(-1, 300), max_size=4))},
    optional=_completion_params,
)
_headers = st.fixed_dictionaries(
    {},
    optional={
        "X-Session-Id": st.text(st.characters(codec="ascii", exclude_characters="\r\n"), max_size=12),
        "X-Priority": st.sampled_from(["realtime", "interactive", "batch", "bogus", ""]),
    },
)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_generation_bodies_never_get_a_server_error(app: FastAPI, path: str) -> None:
    client = TestClient(app)

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given_body(path)
    def check(body: dict[str, object], headers: dict[str, str]) -> None:
        response = client.post(path, json=body, headers=headers)
        assert response.status_code < 500, (body, headers, response.text)
        statuses.add(response.status_code)

    statuses: set[int] = set()
    check()
    assert 200 in statuses  # some generated requests reached the engine and generated
    assert client.get("/healthz").status_code == 200


# Bodies that are valid as far as their fields' types and ranges go, so that they get past the
# schema and reach the engine with the new fields in play: grammars from random (and broken)
# schemas and tools, stop strings, logprobs, n, tool turns.
_valid_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"])}, optional={"parameters": _schema}
        ),
    }
)
_valid_message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user"]),
            "content": st.one_of(
                _text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}))
            ),
        }
    ),
)
_tool_turns = st.builds(
    lambda call, result: [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
    ],
    _call,
    _text,
)
_valid_chat = st.builds(
    lambda messages, turns, options: {"model": MODEL_NAME, "messages": messages + turns, **options},
    st.lists(_valid_message, min_size=1, max_size=2),
    st.one_of(st.just([]), _tool_turns),
    st.fixed_dictionaries(
        {},
        optional={
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.01, 1),
            "seed": st.integers(-(2**70), 2**70),
            "n": st.integers(1, 2),
            "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
            "presence_penalty": st.floats(-2, 2),
            "frequency_penalty": st.floats(-2, 2),
            "logprobs": st.just(True),
            "top_logprobs": st.integers(0, 5),
            "stream": st.booleans(),
            "ignore_eos": st.booleans(),
            "min_tokens": st.integers(0, 2),
            "response_format": _response_format,
            "tools": st.lists(_valid_tool, min_size=1, max_size=2),
            "tool_choice": st.sampled_from(["none", "auto", "required"]),
            "parallel_tool_calls": st.booleans(),
            "return_tokens_as_token_ids": st.booleans(),
        },
    ),
)


def test_bodies_with_the_new_fields_never_get_a_server_error(app: FastAPI) -> None:
    client = TestClient(app)
    reached: set[str] = set()

    @settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_valid_chat)
    def check(body: dict[str, object]) -> None:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code < 500, (body, response.text)
        if response.status_code == 200:
            reached.update(k for k in ("tools", "response_format", "stop", "logprobs", "n") if k in body)

    check()
    assert reached == {"tools", "response_format", "stop", "logprobs", "n"}


def test_a_non_ascii_session_id_is_echoed_percent_encoded(app: FastAPI) -> None:
    """Found by the fuzz test above: echoing such an id as a header value was a 500."""
    client = TestClient(app)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1, "metadata": {"session_id": "Āgent é"}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-session-id"] == "%C4%80gent%20%C3%A9"
    raw = client.post("/v1/completions", json=body | {"metadata": {}}, headers=[("X-Session-Id", b"a\x80b")])
    assert raw.status_code == 200, raw.text
    echoed = raw.headers["x-session-id"]  # the raw byte is read as latin-1, echoed percent-encoded
    assert echoed.startswith("a%") and echoed.endswith("b") and echoed.isascii()


def given_body(path: str):  # type: ignore[no-untyped-def]
    return given(_chat if path == "/v1/chat/completions" else _completion, _headers)


def test_the_server_still_answers_after_fuzzing(app: FastAPI) -> None:
    with TestClient(app) as client:
        assert client.get("/healthz").json()["status"] == "ok"
