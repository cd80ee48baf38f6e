"""Constrained decoding on SmolLM2 through the plain openai client: JSON mode gives valid JSON 50
times out of 50, and ``tool_choice: required`` a valid call 50 times out of 50. Outputs are kept
short (greedy, a few dozen tokens) so that the 100 requests stay within a couple of minutes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from smol_server import ServerProcess, serve_smol

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serve_smol(tmp_path_factory) as server:
        yield server


CITIES = [
    "Paris", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Delhi", "Sydney",
    "Dublin", "Lisbon", "Vienna", "Prague", "Warsaw", "Athens", "Seoul", "Bangkok", "Nairobi", "Quito",
    "Toronto", "Chicago", "Boston", "Denver", "Havana",
]  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    for name, description in (
        ("get_weather", "Get the current weather in a city."),
        ("get_time", "Get the local time in a city."),
    )
]


def test_json_mode_is_valid_json_50_of_50(smol: ServerProcess) -> None:
    client = smol.client()
    system = {"role": "system", "content": 'Reply with a JSON object like {"answer": 42}.'}
    invalid = []
    for i in range(50):
        question = {"role": "user", "content": f"What is {i} plus {i % 7 + 2}?"}
        reply = client.chat.completions.create(
            model=smol.model_id(),
            messages=[system, question],  # type: ignore[list-item]
            response_format={"type": "json_object"},
            max_tokens=32,
        )
        text = reply.choices[0].message.content or ""
        try:
            assert isinstance(json.loads(text), dict)
        except (ValueError, AssertionError):
            invalid.append((i, reply.choices[0].finish_reason, text))
    assert invalid == []


def test_tool_choice_required_is_a_valid_call_50_of_50(smol: ServerProcess) -> None:
    client = smol.client()
    invalid = []
    for i in range(50):
        city = CITIES[i // 2]
        question = f"What is the weather in {city}?" if i % 2 == 0 else f"What time is it in {city}?"
        reply = client.chat.completions.create(
            model=smol.model_id(),
            messages=[{"role": "user", "content": question}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=40,
        )
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        try:
            assert choice.finish_reason == "tool_calls" and len(calls) == 1
            assert calls[0].function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
            arguments = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
            assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
        except (ValueError, AssertionError):
            invalid.append((i, choice.finish_reason, choice.message))
    assert invalid == []
