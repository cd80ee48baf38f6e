"""The Responses API as frameworks use it by default, against a live ``kvstrata serve`` on SmolLM2:
the OpenAI Agents SDK with its default client setup (``set_default_openai_client``: the SDK's
Responses model), streamed and not, and LangChain's ``ChatOpenAI(use_responses_api=True)``.
Issue 31, acceptance 1 (the continuation after a restart is tests/server/test_responses_restart.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest
from agents import Agent, OpenAIProvider, Runner, set_default_openai_client, set_tracing_disabled
from agents.items import ToolCallItem
from agents.models.openai_responses import OpenAIResponsesModel
from agents_sdk import city_guide
from openai import AsyncOpenAI
from smol_server import ServerProcess, serve_smol

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serve_smol(tmp_path_factory) as server:
        yield server


def _agent(smol: ServerProcess) -> Agent:
    """An agent on the SDK's default model: a model name, the default client, the Responses API."""
    set_tracing_disabled(True)  # no trace export: there is no internet here
    set_default_openai_client(
        AsyncOpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0, timeout=600)
    )
    model = OpenAIProvider().get_model(smol.model_id())
    assert isinstance(model, OpenAIResponsesModel)  # the default: the Responses API
    return city_guide(model)


def test_the_agents_sdk_default_client_runs_a_two_tool_agent(smol: ServerProcess) -> None:
    agent = _agent(smol)
    # chained by previous_response_id: each step sends only its new items, the server keeps the rest
    result = asyncio.run(
        Runner.run(agent, "What is the weather and the time in Paris?", auto_previous_response_id=True)
    )

    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert [call.name for call in calls] == ["get_weather", "get_time"]
    assert all(call.arguments == '{"city": "Paris"}' for call in calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == 3
    usages = [response.usage for response in result.raw_responses]
    for previous, current in itertools.pairwise(usages):  # each step reuses the whole step before
        assert current.input_tokens_details.cached_tokens >= 0.9 * previous.input_tokens


def test_the_agents_sdk_streams_a_two_tool_agent(smol: ServerProcess) -> None:
    agent = _agent(smol)

    async def run() -> tuple[object, list[str]]:
        streamed = Runner.run_streamed(agent, "What is the weather and the time in Rome?")
        kinds = [
            event.data.type async for event in streamed.stream_events() if event.type == "raw_response_event"
        ]
        return streamed, kinds

    result, kinds = asyncio.run(run())
    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]  # type: ignore[attr-defined]
    assert [call.name for call in calls] == ["get_weather", "get_time"]
    assert result.final_output.strip()  # type: ignore[attr-defined]
    assert kinds.count("response.completed") == 3
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" in kinds
    # the SDK resent the whole history each step (no chaining): the namespace's blocks still serve it
    usages = [response.usage for response in result.raw_responses]  # type: ignore[attr-defined]
    for previous, current in itertools.pairwise(usages):
        assert current.input_tokens_details.cached_tokens >= 0.8 * previous.input_tokens


def test_langchain_calls_a_tool_through_the_responses_api(smol: ServerProcess) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def lookup_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"Sunny in {city}."

    llm = ChatOpenAI(
        model=smol.model_id(),
        base_url=f"{smol.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        max_tokens=48,
        use_responses_api=True,
    )
    reply = llm.bind_tools([lookup_weather], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is the weather in Paris?"
    )
    assert [call["name"] for call in reply.tool_calls] == ["lookup_weather"]
    assert reply.tool_calls[0]["args"] == {"city": "Paris"}
