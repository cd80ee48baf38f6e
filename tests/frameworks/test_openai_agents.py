"""The OpenAI Agents SDK (``openai-agents``), through its chat-completions model class, against a
live ``kvstrata serve`` on SmolLM2: an agent with two function tools runs a loop of tool calls to
a final answer, and each step reuses the KV of the step before it."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallItem
from agents.models.interface import Model
from openai import AsyncOpenAI
from smol_server import ServerProcess, serve_smol

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serve_smol(tmp_path_factory) as server:
        yield server


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny and 21 C in {city}."


@function_tool
def get_time(city: str) -> str:
    """Get the local time in a city."""
    return f"It is 14:05 in {city}."


class PlannedToolChoice(Model):
    """The SDK's own chat-completions model, with ``tool_choice`` set per step from a plan.

    A 135M model does not decide reliably on its own when to call a tool: the plan makes the
    loop deterministic (the server's grammar then makes each call valid), and everything else,
    the requests, the history resent each step, the tool execution, is the SDK's."""

    def __init__(self, inner: Model, plan: list[str]) -> None:
        self.inner = inner
        self.plan = plan
        self.steps = 0

    def _settings(self, settings: ModelSettings) -> ModelSettings:
        choice = self.plan[min(self.steps, len(self.plan) - 1)]
        self.steps += 1
        return dataclasses.replace(settings, tool_choice=choice)

    async def get_response(
        self, system_instructions: Any, input: Any, model_settings: ModelSettings, *args: Any, **kwargs: Any
    ) -> Any:
        return await self.inner.get_response(
            system_instructions, input, self._settings(model_settings), *args, **kwargs
        )

    def stream_response(
        self, system_instructions: Any, input: Any, model_settings: ModelSettings, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        return self.inner.stream_response(
            system_instructions, input, self._settings(model_settings), *args, **kwargs
        )


def test_an_agent_loop_of_tool_calls_reuses_each_previous_step(smol: ServerProcess) -> None:
    set_tracing_disabled(True)  # no trace export: there is no internet here
    client = AsyncOpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0, timeout=600)
    chat_model = OpenAIChatCompletionsModel(model=smol.model_id(), openai_client=client)
    model = PlannedToolChoice(chat_model, ["required", "get_time", "none"])
    agent = Agent(
        name="city guide",
        instructions="You answer questions about cities. Get the weather, then the local time, then answer.",
        model=model,
        tools=[get_weather, get_time],
        model_settings=ModelSettings(
            parallel_tool_calls=False, max_tokens=48, extra_headers={"X-Session-Id": "agents-sdk-loop"}
        ),
        reset_tool_choice=False,
    )
    result = asyncio.run(Runner.run(agent, "What is the weather and the time in Paris?"))

    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert [call.name for call in calls] == ["get_weather", "get_time"]  # the first one, the model chose
    assert all(call.arguments == '{"city": "Paris"}' for call in calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    usages = [response.usage for response in result.raw_responses]
    assert len(usages) == 3
    for previous, current in itertools.pairwise(usages):
        assert current.input_tokens_details.cached_tokens >= 0.9 * previous.input_tokens
