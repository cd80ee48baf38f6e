"""The OpenAI Agents SDK (``openai-agents``), through its chat-completions model class, against a
live ``kvstrata serve`` on SmolLM2: an agent with two function tools runs a loop of tool calls to
a final answer, and each step reuses the KV of the step before it."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest
from agents import OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.items import ToolCallItem
from agents_sdk import city_guide
from openai import AsyncOpenAI
from smol_server import ServerProcess, serve_smol

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serve_smol(tmp_path_factory) as server:
        yield server


def test_an_agent_loop_of_tool_calls_reuses_each_previous_step(smol: ServerProcess) -> None:
    set_tracing_disabled(True)  # no trace export: there is no internet here
    client = AsyncOpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0, timeout=600)
    chat_model = OpenAIChatCompletionsModel(model=smol.model_id(), openai_client=client)
    agent = city_guide(chat_model, extra_headers={"X-Session-Id": "agents-sdk-loop"})
    result = asyncio.run(Runner.run(agent, "What is the weather and the time in Paris?"))

    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert [call.name for call in calls] == ["get_weather", "get_time"]  # the first one, the model chose
    assert all(call.arguments == '{"city": "Paris"}' for call in calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    usages = [response.usage for response in result.raw_responses]
    assert len(usages) == 3
    for previous, current in itertools.pairwise(usages):
        assert current.input_tokens_details.cached_tokens >= 0.9 * previous.input_tokens
