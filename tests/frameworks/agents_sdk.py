"""What the OpenAI Agents SDK tests share: a city guide agent with two function tools, whose
steps follow a plan (a plain module beside them, as ``smol_server``)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from agents import Agent, ModelSettings, function_tool
from agents.models.interface import Model

__all__ = ["PlannedToolChoice", "city_guide", "get_time", "get_weather"]

PLAN = ["required", "get_time", "none"]
"""The city guide's steps: a tool call (the model chooses which: the weather), the time, the answer."""


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny and 21 C in {city}."


@function_tool
def get_time(city: str) -> str:
    """Get the local time in a city."""
    return f"It is 14:05 in {city}."


class PlannedToolChoice(Model):
    """The SDK's own model (chat completions or Responses), with ``tool_choice`` set per step
    from a plan.

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


def city_guide(model: Model, **settings: Any) -> Agent:
    """An agent on ``model`` with the two tools, its steps following :data:`PLAN`; ``settings``:
    more of its :class:`ModelSettings` (one call per step, 48 tokens at most)."""
    return Agent(
        name="city guide",
        instructions="You answer questions about cities. Get the weather, then the local time, then answer.",
        model=PlannedToolChoice(model, PLAN),
        tools=[get_weather, get_time],
        model_settings=ModelSettings(parallel_tool_calls=False, max_tokens=48, **settings),
        reset_tool_choice=False,
    )
