"""The response object of the Responses API (what ``POST /v1/responses`` and ``GET`` return, and
what the streaming events carry), and the chat request a Responses request runs as."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError

from kvstrata.engine.engine import Response
from kvstrata.server.errors import APIError
from kvstrata.server.responses_api.items import Item
from kvstrata.server.responses_api.schemas import ResponsesRequest
from kvstrata.server.schemas import ChatCompletionRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completions request ``body`` runs as (the same sampling, tools and constraints)."""
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    parallel = body.parallel_tool_calls if body.parallel_tool_calls is not None else True
    logprobs = body.top_logprobs is not None or LOGPROBS_INCLUDE in (body.include or [])
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature if body.temperature is not None else 0.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "seed": body.seed,
        "stream": body.stream,
        "metadata": body.metadata,
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "service_tier": body.service_tier,
        "prompt_cache_key": body.prompt_cache_key,
        "cache_salt": body.cache_salt,
        "top_k": body.top_k,
        "repetition_penalty": body.repetition_penalty,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
    }
    if body.tools:
        fields["tools"] = [tool.as_chat_tool() for tool in body.tools]
        fields["tool_choice"] = choice
        fields["parallel_tool_calls"] = parallel and body.max_tool_calls != 1
    elif choice is not None:
        fields["tool_choice"] = choice  # refused below with chat's message: it needs tools
    if body.text is not None and body.text.format is not None:
        fields["response_format"] = body.text.format.as_response_format()
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise APIError(400, f"{where}: {reason}", param=where or None, code="invalid_value") from exc


def usage(response: Response | None) -> dict[str, Any] | None:
    if response is None:
        return None
    return {
        "input_tokens": response.prompt_tokens,
        "input_tokens_details": {"cached_tokens": response.cached_tokens},
        "output_tokens": response.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": response.prompt_tokens + response.completion_tokens,
    }


def status_of(response: Response) -> str:
    return "incomplete" if response.finish_reason == "length" else "completed"


def response_object(
    body: ResponsesRequest,
    response_id: str,
    created_at: int,
    *,
    model: str,
    status: str,
    output: list[Item],
    result: Response | None = None,
    extension: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response object (``result``: the engine's, once it finished)."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    text_format = (
        body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text and body.text.format
        else None
    )
    obj: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "service_tier": body.service_tier or "default",
        "store": body.store,
        "temperature": body.temperature if body.temperature is not None else 0.0,
        "text": {"format": text_format or {"type": "text"}},
        "tool_choice": choice or ("auto" if tools else "none"),
        "tools": tools,
        "top_logprobs": body.top_logprobs,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "truncation": body.truncation or "disabled",
        "usage": usage(result),
        "user": body.user,
        "metadata": body.metadata or {},
        "prompt_cache_key": body.prompt_cache_key,
        "safety_identifier": body.safety_identifier,
    }
    if extension is not None:
        obj["kvstrata"] = extension
    return obj
