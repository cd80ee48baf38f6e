"""The Responses API against a live server on the tiny model: stored responses as session
documents, chains by ``previous_response_id`` in one session (a fork for an older response),
function calls and their outputs, streaming events, tenants, and bad input."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_builders import MODEL_NAME, LiveServer, live_server, tiny_model

from kvstrata.config import GcConfig
from kvstrata.server.auth import ApiKeys

KEYS = ApiKeys({"key-a": "tenant-a", "key-b": "tenant-b"})
INSTRUCTIONS = "You answer questions about the weather."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("responses")
    with live_server(tiny_model(root), root, api_keys=KEYS, response_ttl_s=3600.0) as srv:
        yield srv


def client(server: LiveServer, key: str = "key-a") -> openai.OpenAI:
    return server.client(key)


def create(server: LiveServer, key: str = "key-a", **kw: Any) -> Any:
    kw.setdefault("max_output_tokens", 6)
    kw.setdefault("instructions", INSTRUCTIONS)
    return client(server, key).responses.create(model=MODEL_NAME, **kw)


def session_of(response: Any) -> str:
    return str(response.model_extra["kvstrata"]["session_id"])


def sessions(server: LiveServer, tenant: str = "tenant-a") -> set[str]:
    return {s.id for s in server.store.list_sessions(tenant)}


def test_a_chain_is_one_session_that_reuses_its_kv(server: LiveServer) -> None:
    before = sessions(server)
    first = create(server, input="Is it sunny in Paris?")
    second = create(server, input="And tomorrow?", previous_response_id=first.id)
    third = create(server, input="And in Rome?", previous_response_id=second.id)
    assert session_of(first) == session_of(second) == session_of(third) == first.id
    assert sessions(server) - before == {first.id}  # one session for the chain, with the response TTL
    assert server.store.session(first.id, "tenant-a").ttl_s == 3600.0
    for previous, current in ((first, second), (second, third)):  # only the new input is sent
        assert current.usage.input_tokens_details.cached_tokens >= previous.usage.input_tokens
    items = client(server).responses.input_items.list(third.id, order="asc").data
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items[1].content[0].text == first.output_text and items[4].content[0].text == "And in Rome?"
    newest_first = client(server).responses.input_items.list(third.id, limit=2)
    assert [i.id for i in newest_first.data] == [items[4].id, items[3].id] and newest_first.has_more


def test_continuing_an_older_response_forks_its_session(server: LiveServer) -> None:
    first = create(server, input="Is it sunny in Paris?")
    second = create(server, input="And tomorrow?", previous_response_id=first.id)
    tokens = server.store.session(first.id, "tenant-a").num_tokens
    branch = create(server, input="And in Oslo?", previous_response_id=first.id)
    assert session_of(branch) == branch.id != first.id
    fork = server.store.session(branch.id, "tenant-a")
    assert fork.parent == first.id and fork.ttl_s == 3600.0
    assert branch.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # shared blocks
    assert server.store.session(first.id, "tenant-a").num_tokens == tokens  # the chain is untouched
    assert client(server).responses.retrieve(second.id).output_text == second.output_text
    items = client(server).responses.input_items.list(branch.id, order="asc").data
    assert [i.content[0].text for i in items if i.type == "message" and i.role == "user"] == [
        "Is it sunny in Paris?",
        "And in Oslo?",
    ]


def test_retrieve_and_delete(server: LiveServer) -> None:
    made = create(server, input="Is it sunny in Paris?", metadata={"trip": "7"})
    got = client(server).responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump() and got.metadata == {"trip": "7"}
    client(server).responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client(server).responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        create(server, input="More?", previous_response_id=made.id)
    # deleting the session deletes its responses
    kept = create(server, input="Is it sunny in Paris?")
    with server.http("key-a") as http:
        assert http.delete(f"/v1/sessions/{kept.id}").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client(server).responses.retrieve(kept.id)


def test_stored_responses_expire_with_their_sessions_ttl(server: LiveServer) -> None:
    made = create(server, input="Is it sunny in Paris?")
    kept = create(server, input="Is it sunny in Rome?", extra_headers={"X-Session-Id": "no-ttl"})
    # gc an hour and a minute on: past the chain's TTL (the server's response_ttl_s, 3600 s)
    server.store.maintenance.collect_garbage(GcConfig(grace_s=0.0), now=time.time() + 3660)
    assert made.id not in sessions(server) and "no-ttl" in sessions(server)
    with pytest.raises(openai.NotFoundError):
        client(server).responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        create(server, input="More?", previous_response_id=made.id)
    assert client(server).responses.retrieve(kept.id).output_text == kept.output_text


def test_store_false_keeps_nothing(server: LiveServer) -> None:
    before = sessions(server)
    made = create(server, input="Is it sunny in Paris?", store=False)
    assert made.store is False and session_of(made) == "None"
    assert sessions(server) == before
    with pytest.raises(openai.NotFoundError):
        client(server).responses.retrieve(made.id)


def test_a_named_session_holds_the_chain(server: LiveServer) -> None:
    headers = {"X-Session-Id": "named-chain"}
    first = create(server, input="Is it sunny in Paris?", extra_headers=headers)
    second = create(
        server, input="And tomorrow?", previous_response_id=first.id, prompt_cache_key="named-chain"
    )
    assert session_of(first) == session_of(second) == "named-chain"
    assert server.store.session("named-chain", "tenant-a").ttl_s is None  # the caller's session
    with pytest.raises(openai.BadRequestError) as info:  # it belongs to another session
        create(
            server, input="And then?", previous_response_id=second.id, extra_headers={"X-Session-Id": "other"}
        )
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_function_call_and_its_output(server: LiveServer) -> None:
    call = create(
        server, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=200
    )
    assert call.status == "completed" and [o.type for o in call.output] == ["function_call"]
    fc = call.output[0]
    assert fc.name == "get_weather" and set(json.loads(fc.arguments)) == {"city"}
    answer = create(
        server,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "Sunny."}],
        previous_response_id=call.id,
        tools=[WEATHER],
        tool_choice="none",
    )
    # the call renders back as the text it was generated as: the whole previous step is reused
    assert (
        answer.usage.input_tokens_details.cached_tokens
        >= call.usage.input_tokens + call.usage.output_tokens - 1
    )
    kinds = [i.type for i in client(server).responses.input_items.list(answer.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]


def test_a_full_history_sent_without_chaining(server: LiveServer) -> None:
    """What the Agents SDK sends by default: the whole history, the call and its output included."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    call = create(server, input=history, tools=[WEATHER], tool_choice="required", max_output_tokens=200)
    history += [item.model_dump(exclude_none=True) for item in call.output]
    history.append({"type": "function_call_output", "call_id": call.output[0].call_id, "output": "Sunny."})
    answer = create(server, input=history, tools=[WEATHER], tool_choice="none")
    assert answer.previous_response_id is None and session_of(answer) != session_of(call)
    # a new session, but the namespace's blocks of the step before are shared
    assert answer.usage.input_tokens_details.cached_tokens >= 0.8 * call.usage.input_tokens


def _events(server: LiveServer, **kw: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL_NAME, "instructions": INSTRUCTIONS, "stream": True, **kw}
    events = []
    with server.http("key-a") as http, http.stream("POST", "/v1/responses", json=body) as reply:
        assert reply.status_code == 200
        kind = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == kind
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_streamed_text_events_in_openais_order(server: LiveServer) -> None:
    events = _events(server, input="Is it sunny in Paris?", max_output_tokens=6)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens ended it
    ]
    final = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (
        final["output"][0]["content"][0]["text"] == text
        and final["incomplete_details"]["reason"] == "max_output_tokens"
    )
    with server.http("key-a") as http:  # stored before the last event went out
        assert http.get(f"/v1/responses/{final['id']}").json() == final


def test_streamed_arguments_arrive_as_they_are_generated(server: LiveServer) -> None:
    events = _events(server, input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=200)
    kinds = [e["type"] for e in events]
    added = kinds.index("response.output_item.added")
    deltas = [i for i, k in enumerate(kinds) if k == "response.function_call_arguments.delta"]
    done = kinds.index("response.function_call_arguments.done")
    assert events[added]["item"]["type"] == "function_call" and events[added]["item"]["arguments"] == ""
    assert (
        len(deltas) > 1 and added < deltas[0] and deltas[-1] < done
    )  # the first before the call is complete
    arguments = "".join(events[i]["delta"] for i in deltas)
    assert arguments == events[done]["arguments"] and json.loads(arguments)
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert final["output"][0]["arguments"] == arguments and final["output"][0]["status"] == "completed"
    assert client(server).responses.retrieve(final["id"]).output[0].arguments == arguments


def test_the_openai_clients_streams_continue_a_chain(server: LiveServer) -> None:
    """``responses.create(stream=True)`` and ``responses.stream(...)`` of the official client: the
    events it parses, the final response it assembles, and a streamed step chained to a stored one."""
    first = create(server, input="Is it sunny in Paris?")
    events = list(create(server, input="And tomorrow?", previous_response_id=first.id, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    streamed = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed.output_text == text and streamed.previous_response_id == first.id
    assert session_of(streamed) == first.id
    assert streamed.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens > 0
    with client(server).responses.stream(
        model=MODEL_NAME,
        instructions=INSTRUCTIONS,
        input="Weather in Rome?",
        previous_response_id=streamed.id,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=200,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        call = stream.get_final_response()
    assert call.output[0].type == "function_call" and "".join(deltas) == call.output[0].arguments
    assert call.usage.input_tokens_details.cached_tokens >= streamed.usage.input_tokens
    assert client(server).responses.retrieve(call.id).output[0].arguments == call.output[0].arguments


def _state(server: LiveServer) -> tuple[list[str], list[str]]:
    return sorted(sessions(server)), sorted(sessions(server, "tenant-b"))


@pytest.mark.parametrize(
    ("request_fields", "status", "param"),
    [
        ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"previous_response_id": "OTHER_TENANT"}, 404, "previous_response_id"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}]},
            400,
            "input.0.call_id",
        ),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input.0.content",
        ),
        ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({"background": True}, 400, "background"),
        ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
        ({"input": []}, 400, "input"),
    ],
)
def test_bad_input_is_one_4xx_and_changes_nothing(
    server: LiveServer, request_fields: dict[str, Any], status: int, param: str
) -> None:
    if request_fields.get("previous_response_id") == "OTHER_TENANT":
        request_fields = {"previous_response_id": create(server, key="key-b", input="Hello").id}
    before = _state(server)
    body = {"model": MODEL_NAME, "input": "Hello", "max_output_tokens": 4, **request_fields}
    with server.http("key-a") as http:
        reply = http.post("/v1/responses", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert _state(server) == before


def test_another_tenants_response_is_not_found(server: LiveServer) -> None:
    theirs = create(server, key="key-b", input="Hello")
    with server.http("key-a") as http:
        assert http.get(f"/v1/responses/{theirs.id}").status_code == 404
        assert http.delete(f"/v1/responses/{theirs.id}").status_code == 404
        assert http.get(f"/v1/responses/{theirs.id}/input_items").status_code == 404
    assert client(server, "key-b").responses.retrieve(theirs.id).id == theirs.id
    with pytest.raises(httpx.HTTPStatusError):
        server.http().get("/v1/responses/x").raise_for_status()  # no key: 401
