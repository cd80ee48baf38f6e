"""LangChain's ``ChatOpenAI`` against a live ``kvstrata serve`` on SmolLM2: ``bind_tools`` gets a
tool call, ``with_structured_output`` (json_schema) a valid pydantic object."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from smol_server import ServerProcess, serve_smol

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serve_smol(tmp_path_factory) as server:
        yield server


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny and 21 C in {city}."


class Weather(BaseModel):
    """A weather report."""

    city: str = Field(max_length=24)
    temperature_c: int
    sunny: bool


def llm(server: ServerProcess, session: str | None = None) -> ChatOpenAI:
    headers = {"X-Session-Id": session} if session else None
    return ChatOpenAI(
        model=server.model_id(),
        base_url=f"{server.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        max_tokens=48,  # type: ignore[call-arg]
        temperature=0,
        max_retries=0,
        default_headers=headers,
    )


def test_bind_tools_produces_a_tool_call(smol: ServerProcess) -> None:
    chat = llm(smol, "langchain-tools").bind_tools(
        [get_weather], tool_choice="required", parallel_tool_calls=False
    )
    question = HumanMessage("What is the weather in Paris?")
    reply = chat.invoke([question])
    assert isinstance(reply, AIMessage)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    # the tool's result goes back as LangChain sends it; the next turn reuses the first one's KV
    result = ToolMessage(
        get_weather.invoke(reply.tool_calls[0]["args"]), tool_call_id=reply.tool_calls[0]["id"]
    )
    # (with the same tools: they are part of the prompt, so the prefix stays the same)
    answer = (
        llm(smol, "langchain-tools")
        .bind_tools([get_weather], tool_choice="none")
        .invoke([question, reply, result])
    )
    assert isinstance(answer.content, str) and answer.content
    first = reply.usage_metadata
    cached = answer.usage_metadata["input_token_details"]["cache_read"]  # type: ignore[index]
    assert first is not None and cached >= first["input_tokens"]


def test_with_structured_output_returns_a_valid_object(smol: ServerProcess) -> None:
    structured = llm(smol).with_structured_output(Weather, method="json_schema")
    report = structured.invoke("Paris is sunny today, 21 degrees Celsius. Report the weather.")
    assert isinstance(report, Weather)
    assert report == Weather(city="Paris", temperature_c=21, sunny=True)
