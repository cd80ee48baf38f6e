"""The OpenAI-compatible routes: chat completions, completions (both streaming or not), models.

A request belongs to a session named by the ``X-Session-Id`` header (or ``metadata.session_id``);
the engine reuses that session's stored KV and prefills only what is new. A request without one
is stateless: it runs in a throwaway session that is deleted afterwards (the full blocks it
wrote stay shared within the tenant's namespace, so a repeated system prompt is still reused).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvstrata.engine.engine import GenerationRequest, Response
from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.priority import Priority
from kvstrata.server.context import ServerContext
from kvstrata.server.deps import context, require_tenant
from kvstrata.server.errors import APIError, from_kvstrata
from kvstrata.server.schemas import ChatCompletionRequest, CompletionRequest, GenerationParams, usage
from kvstrata.store.sessions import validate_session_id

router = APIRouter()

STATELESS_PREFIX = "anon-"


@dataclass(frozen=True, slots=True)
class _Job:
    kind: str  # "chat" or "text"
    session_id: str
    stateless: bool
    namespace: str
    priority: Priority
    max_new_tokens: int
    temperature: float
    seed: int | None
    messages: list[dict[str, str]] | None
    prompt: str | None
    include_usage: bool


def _job(
    ctx: ServerContext,
    request: Request,
    body: GenerationParams,
    tenant: str,
    *,
    messages: list[dict[str, str]] | None = None,
    prompt: str | None = None,
) -> _Job:
    if not ctx.config.serves(body.model):
        raise APIError(
            404,
            f"model {body.model!r} is not served here; use {ctx.config.model_name!r}",
            param="model",
            code="model_not_found",
        )
    max_tokens = body.max_completion_tokens or body.max_tokens or ctx.config.default_max_tokens
    if max_tokens > ctx.config.max_tokens_limit:
        raise APIError(
            400,
            f"max_tokens must be <= {ctx.config.max_tokens_limit}",
            param="max_tokens",
            code="invalid_value",
        )
    session_id = request.headers.get("x-session-id") or (body.metadata or {}).get("session_id")
    try:
        if session_id is not None:
            validate_session_id(session_id)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="X-Session-Id", code="invalid_value") from exc
    try:
        priority = Priority.parse(request.headers.get("x-priority", Priority.INTERACTIVE.value))
    except ConfigError as exc:
        raise APIError(400, str(exc), param="X-Priority", code="invalid_value") from exc
    return _Job(
        kind="chat" if messages is not None else "text",
        session_id=session_id or f"{STATELESS_PREFIX}{uuid.uuid4().hex}",
        stateless=session_id is None,
        namespace=tenant,
        priority=priority,
        max_new_tokens=max_tokens,
        temperature=body.temperature,
        seed=body.seed,
        messages=messages,
        prompt=prompt,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


def _prepare(ctx: ServerContext, job: _Job) -> GenerationRequest:
    """Everything that can refuse the request, before anything is written to the store."""
    if not job.stateless and not ctx.config.create_sessions:
        ctx.store.session(job.session_id, job.namespace)  # SessionNotFoundError: a 404
    request = GenerationRequest(
        job.session_id,
        messages=job.messages,
        prompt=job.prompt,
        max_new_tokens=job.max_new_tokens,
        temperature=job.temperature,
        namespace=job.namespace,
        priority=job.priority,
        seed=job.seed,
    )
    prompt_tokens = len(ctx.engine.prompt_token_ids(request))
    if prompt_tokens > ctx.config.max_prompt_tokens:
        raise APIError(
            400,
            f"the prompt has {prompt_tokens} tokens; the most this server takes is "
            f"{ctx.config.max_prompt_tokens}",
            param="messages" if job.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    return request


def _finish(ctx: ServerContext, job: _Job) -> None:
    if job.stateless:
        ctx.store.delete_session(job.session_id, job.namespace)
        ctx.engine.forget(job.session_id, job.namespace)


def _api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, KVStrataError):
        return from_kvstrata(exc)
    raise exc


def _run(ctx: ServerContext, job: _Job) -> Response:
    gauge = ctx.metrics.in_flight.labels(job.priority.value)
    gauge.inc()
    try:
        with ctx.lock.hold(job.priority):
            request = _prepare(ctx, job)
            try:
                response = ctx.engine.run(request)
            finally:
                _finish(ctx, job)
    finally:
        gauge.dec()
    ctx.metrics.observe(response)
    return response


def _extension(job: _Job, response: Response) -> dict[str, Any]:
    return {
        "session_id": None if job.stateless else job.session_id,
        "cached_by_tier": response.cached_by_tier,
        "prefill_tokens": response.prefill_tokens,
        "ttft_ms": round(response.ttft_ms, 3),
        "decode_tokens_per_s": round(response.decode_tokens_per_s, 3),
        "recomputed_reason": response.recomputed_reason,
    }


def _headers(job: _Job) -> dict[str, str]:
    """The session id, echoed; one that is not printable ASCII (from ``metadata.session_id``, or
    a header's raw bytes) is percent-encoded as UTF-8, since header values are bytes."""
    if job.stateless:
        return {}
    session_id = job.session_id
    if not all(" " <= c <= "~" for c in session_id):
        session_id = quote(session_id, safe="")
    return {"X-Session-Id": session_id}


def _usage(response: Response) -> dict[str, Any]:
    return usage(response.prompt_tokens, response.completion_tokens, response.cached_tokens)


@router.get("/v1/models")
async def list_models(request: Request, tenant: str = Depends(require_tenant)) -> dict[str, Any]:
    ctx = context(request)
    return {
        "object": "list",
        "data": [{"id": ctx.config.model_name, "object": "model", "created": 0, "owned_by": "kvstrata"}],
    }


async def _respond(
    ctx: ServerContext,
    job: _Job,
    *,
    stream: bool,
    id_prefix: str,
    kind: str,
    choice: Callable[[Response], dict[str, Any]],
) -> JSONResponse | StreamingResponse:
    """Stream the job as server-sent events, or run it and answer one JSON body of ``kind``."""
    if stream:
        return await _stream(ctx, job)
    try:
        response = await run_in_threadpool(_run, ctx, job)
    except (APIError, KVStrataError) as exc:
        raise _api_error(exc) from exc
    return JSONResponse(
        {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": ctx.config.model_name,
            "choices": [
                {"index": 0, **choice(response), "finish_reason": response.finish_reason, "logprobs": None}
            ],
            "usage": _usage(response),
            "kvstrata": _extension(job, response),
        },
        headers=_headers(job),
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, tenant: str = Depends(require_tenant)
) -> JSONResponse | StreamingResponse:
    ctx = context(request)
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    job = _job(ctx, request, body, tenant, messages=messages)
    return await _respond(
        ctx,
        job,
        stream=bool(body.stream),
        id_prefix="chatcmpl",
        kind="chat.completion",
        choice=lambda r: {"message": {"role": "assistant", "content": r.text}},
    )


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, tenant: str = Depends(require_tenant)
) -> JSONResponse | StreamingResponse:
    ctx = context(request)
    job = _job(ctx, request, body, tenant, prompt=body.prompt)
    return await _respond(
        ctx,
        job,
        stream=bool(body.stream),
        id_prefix="cmpl",
        kind="text_completion",
        choice=lambda r: {"text": r.text},
    )


# -- streaming ---------------------------------------------------------------------------------


def _generate_in_thread(
    ctx: ServerContext, job: _Job, emit: Callable[[str, Any], None], cancelled: threading.Event
) -> None:
    """Run the request, emitting ("error", exc) if it is refused before it starts, or ("start",),
    then ("delta", text)..., then ("done", Response) or ("fail", exc). Every exit emits, so the
    response waiting on these events never hangs."""
    gauge = ctx.metrics.in_flight.labels(job.priority.value)
    gauge.inc()
    started = False
    try:
        with ctx.lock.hold(job.priority):
            request = _prepare(ctx, job)
            started = True
            emit("start", None)
            stream = ctx.engine.stream(request)
            try:
                for delta in stream:
                    if cancelled.is_set():
                        stream.close()  # the client left: stop decoding, persist nothing
                        emit("fail", APIError(499, "the client closed the stream", type="server_error"))
                        return
                    emit("delta", delta)
            finally:
                _finish(ctx, job)
        assert stream.response is not None
        ctx.metrics.observe(stream.response)
        emit("done", stream.response)
    except (APIError, KVStrataError) as exc:
        emit("fail" if started else "error", exc)
    except Exception as exc:
        # not ours: the client gets a 500 (or an error event), and the worker's log the trace
        emit("fail" if started else "error", exc)
        raise
    finally:
        gauge.dec()


async def _stream(ctx: ServerContext, job: _Job) -> StreamingResponse:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def emit(kind: str, value: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (kind, value))

    loop.run_in_executor(None, _generate_in_thread, ctx, job, emit, cancelled)
    kind, value = await events.get()
    if kind == "error":
        raise _api_error(value)
    chunk_id = f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        body = {"id": chunk_id, "object": obj, "created": created, "model": ctx.config.model_name}
        return f"data: {_json({**body, 'choices': choices, **extra})}\n\n"

    def choice(text: str | None, finish_reason: str | None) -> dict[str, Any]:
        if job.kind == "chat":
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}

    async def body() -> AsyncIterator[str]:
        try:
            if job.kind == "chat":
                yield chunk(
                    [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
                )
            while True:
                kind, value = await events.get()
                if kind == "delta":
                    yield chunk([choice(value, None)])
                elif kind == "done":
                    yield chunk([choice(None, value.finish_reason)])
                    if job.include_usage:
                        yield chunk([], usage=_usage(value), kvstrata=_extension(job, value))
                    break
                else:  # "fail": the status line is sent already, so the error is an event
                    yield f"data: {_json(_stream_error(value).body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            cancelled.set()

    return StreamingResponse(body(), media_type="text/event-stream", headers=_headers(job))


def _stream_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, KVStrataError):
        return from_kvstrata(exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
