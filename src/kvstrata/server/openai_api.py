"""The OpenAI-compatible routes: chat completions, completions (both streaming or not), models.

How a request becomes a job and runs (its session, namespace, priority, choices) is
:mod:`kvstrata.server.jobs`; streaming is :mod:`kvstrata.server.streaming`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvstrata.engine.grammar import GrammarSpec
from kvstrata.errors import KVStrataError
from kvstrata.server import responses
from kvstrata.server.chat import prepare_chat, response_schema
from kvstrata.server.context import ServerContext
from kvstrata.server.deps import context, require_tenant
from kvstrata.server.errors import APIError
from kvstrata.server.jobs import (
    Job,
    api_error,
    build_job,
    echo_text,
    extension,
    headers,
    run_job,
    total_usage,
)
from kvstrata.server.schemas import ChatCompletionRequest, CompletionRequest
from kvstrata.server.streaming import stream_job

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request, tenant: str = Depends(require_tenant)) -> dict[str, Any]:
    ctx = context(request)
    return {
        "object": "list",
        "data": [{"id": ctx.config.model_name, "object": "model", "created": 0, "owned_by": "kvstrata"}],
    }


async def _respond(ctx: ServerContext, job: Job, *, stream: bool) -> JSONResponse | StreamingResponse:
    """Stream the job as server-sent events, or run it and answer one JSON body."""
    if stream:
        return await stream_job(ctx, job)
    try:
        results = await run_in_threadpool(run_job, ctx, job)
    except (APIError, KVStrataError) as exc:
        raise api_error(exc) from exc
    text_of = job.token_text(ctx.engine.model.tokenizer)
    if job.kind == "chat":
        choices = [
            responses.chat_choice(i, r, reads_calls=job.reads_calls, text_of=text_of)
            for i, r in enumerate(results)
        ]
    else:
        echo = echo_text(ctx, job)
        choices = [responses.text_choice(i, r, text_of=text_of, echo=echo) for i, r in enumerate(results)]
    return JSONResponse(
        {
            "id": f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": ctx.config.model_name,
            "choices": choices,
            "usage": total_usage(results),
            "kvstrata": extension(job, results[0]),
        },
        headers=headers(job),
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, tenant: str = Depends(require_tenant)
) -> JSONResponse | StreamingResponse:
    ctx = context(request)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    chat = prepare_chat(body, ctx.engine.model.tokenizer)
    job = build_job(
        ctx,
        request,
        body,
        tenant,
        grammar=chat.grammar,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        whole_items=chat.whole_items,
        messages=chat.messages,
        tools=chat.template_tools,
        reads_calls=chat.reads_calls,
        template_kwargs=body.chat_template_kwargs,
    )
    return await _respond(ctx, job, stream=body.stream)


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, tenant: str = Depends(require_tenant)
) -> JSONResponse | StreamingResponse:
    ctx = context(request)
    if body.echo and body.logprobs is not None:
        raise APIError(
            400,
            "echo with logprobs is not supported: the prompt's log-probabilities are not computed",
            param="echo",
            code="unsupported_value",
        )
    schema = response_schema(body.response_format)
    prompt: dict[str, Any] = (
        {"prompt": body.prompt} if isinstance(body.prompt, str) else {"prompt_ids": tuple(body.prompt)}
    )
    job = build_job(
        ctx,
        request,
        body,
        tenant,
        grammar=GrammarSpec.json_schema(schema) if schema is not None else None,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        echo=body.echo,
        **prompt,
    )
    return await _respond(ctx, job, stream=body.stream)
