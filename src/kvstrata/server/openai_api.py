"""The OpenAI-compatible routes: chat completions, completions (both streaming or not), models.

A request belongs to a session named by the ``X-Session-Id`` header (or ``metadata.session_id``);
the engine reuses that session's stored KV and prefills only what is new. A request without one
is stateless: it runs in a throwaway session that is deleted afterwards (the full blocks it
wrote stay shared within the tenant's namespace, so a repeated system prompt is still reused).

Requests run together in the engine's batch (continuous batching: one forward pass per step for
every running request, realtime first; see :mod:`kvstrata.engine`). ``n`` choices run one after
another on the same session: each reuses the prompt's KV, and the session keeps the last
choice's tokens (the next turn reuses the prompt either way).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvstrata.engine.engine import GenerationRequest, Response
from kvstrata.engine.grammar import GrammarSpec
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.priority import Priority
from kvstrata.server import responses
from kvstrata.server.chat import prepare_chat, response_schema
from kvstrata.server.context import ServerContext
from kvstrata.server.deps import context, require_tenant
from kvstrata.server.errors import APIError, from_kvstrata
from kvstrata.server.schemas import ChatCompletionRequest, CompletionRequest, GenerationParams, usage
from kvstrata.store.sessions import validate_session_id

router = APIRouter()

STATELESS_PREFIX = "anon-"


@dataclass(frozen=True, slots=True)
class Job:
    """One HTTP request, ready to run: its session, its prompt and how it decodes."""

    kind: str  # "chat" or "text"
    session_id: str
    stateless: bool
    namespace: str
    priority: Priority
    sampling: SamplingParams
    n: int
    include_usage: bool
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    reads_calls: bool = False
    tokens_as_ids: bool = False

    def token_text(self, tokenizer: Any) -> responses.TokenText | None:
        """How logprobs name tokens (None: no logprobs asked for)."""
        return responses.TokenText(tokenizer, as_ids=self.tokens_as_ids) if self.sampling.logprobs else None

    def request(self, choice: int = 0) -> GenerationRequest:
        return GenerationRequest(
            self.session_id,
            messages=self.messages,
            prompt=self.prompt,
            prompt_ids=self.prompt_ids,
            namespace=self.namespace,
            priority=self.priority,
            sampling=self.sampling.for_choice(choice),
            tools=self.tools,
        )


def _job(
    ctx: ServerContext,
    request: Request,
    body: GenerationParams,
    tenant: str,
    *,
    grammar: GrammarSpec | None,
    logprobs: bool,
    top_logprobs: int,
    **prompt: Any,
) -> Job:
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
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            stop=tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            grammar=grammar,
        )
    except ConfigError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
    return Job(
        kind="chat" if "messages" in prompt else "text",
        session_id=session_id or f"{STATELESS_PREFIX}{uuid.uuid4().hex}",
        stateless=session_id is None,
        namespace=tenant,
        priority=priority,
        sampling=sampling,
        n=body.n,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        tokens_as_ids=body.return_tokens_as_token_ids,
        **prompt,
    )


def prepare(ctx: ServerContext, job: Job) -> list[GenerationRequest]:
    """The engine requests of ``job``'s choices; everything that can refuse the request runs
    here, before anything is written to the store."""
    if not job.stateless and not ctx.config.create_sessions:
        with ctx.store_lock:
            ctx.store.session(job.session_id, job.namespace)  # SessionNotFoundError: a 404
    requests = [job.request(i) for i in range(job.n)]
    prompt_tokens = len(ctx.engine.prompt_token_ids(requests[0]))
    if prompt_tokens > ctx.config.max_prompt_tokens:
        raise APIError(
            400,
            f"the prompt has {prompt_tokens} tokens; the most this server takes is "
            f"{ctx.config.max_prompt_tokens}",
            param="messages" if job.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    try:
        ctx.engine.decoder(requests[0])  # an invalid grammar or stop token: a 400 now, not mid-stream
    except ConfigError as exc:
        param = "stop_token_ids" if "stop_token_ids" in str(exc) else None
        raise APIError(400, str(exc), param=param, code="invalid_value") from exc
    return requests


def finish(ctx: ServerContext, job: Job) -> None:
    """After the job's last choice has committed: a stateless job's session goes."""
    if job.stateless:
        with ctx.store_lock:
            ctx.store.delete_session(job.session_id, job.namespace)
            ctx.engine.forget(job.session_id, job.namespace)


def api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, KVStrataError):
        return from_kvstrata(exc)
    raise exc


def _run(ctx: ServerContext, job: Job) -> list[Response]:
    """Run the job's choices in the engine's batch, one after the other (they share a session)."""
    gauge = ctx.metrics.in_flight.labels(job.priority.value)
    gauge.inc()
    try:
        requests = prepare(ctx, job)
        try:
            results = [ctx.engine.run(request) for request in requests]
        finally:
            finish(ctx, job)
    finally:
        gauge.dec()
    for response in results:
        ctx.metrics.observe(response, job.priority)
    return results


def extension(job: Job, response: Response) -> dict[str, Any]:
    return {
        "session_id": None if job.stateless else job.session_id,
        "cached_by_tier": response.cached_by_tier,
        "prefill_tokens": response.prefill_tokens,
        "ttft_ms": round(response.ttft_ms, 3),
        "decode_tokens_per_s": round(response.decode_tokens_per_s, 3),
        "recomputed_reason": response.recomputed_reason,
    }


def headers(job: Job) -> dict[str, str]:
    """The session id, echoed; one that is not printable ASCII (from ``metadata.session_id``, or
    a header's raw bytes) is percent-encoded as UTF-8, since header values are bytes."""
    from urllib.parse import quote

    if job.stateless:
        return {}
    session_id = job.session_id
    if not all(" " <= c <= "~" for c in session_id):
        session_id = quote(session_id, safe="")
    return {"X-Session-Id": session_id}


def total_usage(results: list[Response]) -> dict[str, Any]:
    """The prompt counted once (the choices share it), the completions of all choices."""
    first = results[0]
    return usage(first.prompt_tokens, sum(r.completion_tokens for r in results), first.cached_tokens)


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
        from kvstrata.server.streaming import stream_job

        return await stream_job(ctx, job)
    try:
        results = await run_in_threadpool(_run, ctx, job)
    except (APIError, KVStrataError) as exc:
        raise api_error(exc) from exc
    text_of = job.token_text(ctx.engine.model.tokenizer)
    if job.kind == "chat":
        choices = [
            responses.chat_choice(i, r, reads_calls=job.reads_calls, text_of=text_of)
            for i, r in enumerate(results)
        ]
    else:
        choices = [responses.text_choice(i, r, text_of=text_of) for i, r in enumerate(results)]
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
    job = _job(
        ctx,
        request,
        body,
        tenant,
        grammar=chat.grammar,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        messages=chat.messages,
        tools=chat.template_tools,
        reads_calls=chat.reads_calls,
    )
    return await _respond(ctx, job, stream=body.stream)


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, tenant: str = Depends(require_tenant)
) -> JSONResponse | StreamingResponse:
    ctx = context(request)
    schema = response_schema(body.response_format)
    prompt: dict[str, Any] = (
        {"prompt": body.prompt} if isinstance(body.prompt, str) else {"prompt_ids": tuple(body.prompt)}
    )
    job = _job(
        ctx,
        request,
        body,
        tenant,
        grammar=GrammarSpec.json_schema(schema) if schema is not None else None,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        **prompt,
    )
    return await _respond(ctx, job, stream=body.stream)
