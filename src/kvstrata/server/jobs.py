"""A request made ready to run (:class:`Job`) and running it in the engine; what the chat and
text completions routes and the Responses API share.

A request belongs to a session named by the ``X-Session-Id`` header, else ``metadata.session_id``,
else OpenAI's ``prompt_cache_key``; the engine reuses that session's stored KV and prefills only
what is new. A request without one is stateless: it runs in a throwaway session that is deleted
afterwards (the full blocks it wrote stay shared within the namespace, so a repeated system
prompt is still reused). The namespace is the caller's tenant, or with vLLM's ``cache_salt`` a
namespace of the tenant and the salt, whose KV no request with another salt can reach.

Requests run together in the engine's batch (continuous batching: one forward pass per step for
every running request, realtime first; see :mod:`kvstrata.engine`). ``n`` choices run one after
another on the same session: each reuses the prompt's KV, and the session keeps the last
choice's tokens (the next turn reuses the prompt either way).
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from fastapi import Request

from kvstrata.engine.engine import GenerationRequest, Response
from kvstrata.engine.grammar import GrammarSpec
from kvstrata.engine.sampling import SamplingParams
from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.priority import Priority
from kvstrata.runtime import single_threaded_torch
from kvstrata.server import responses
from kvstrata.server.context import ServerContext
from kvstrata.server.errors import APIError, from_kvstrata
from kvstrata.server.schemas import GenerationParams, usage
from kvstrata.store.sessions import validate_session_id

STATELESS_PREFIX = "anon-"
SALT_SEPARATOR = ":salt-"
# OpenAI's service tiers, as the priority class they run in when no X-Priority header says
_TIER_PRIORITY = {"flex": Priority.BACKGROUND, "priority": Priority.REALTIME}


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
    template_kwargs: Mapping[str, Any] | None = None
    echo: bool = False
    """Completions: the text starts with the prompt."""
    own_session: bool = False
    """The session is the server's to make (a Responses chain's), whatever ``create_sessions``."""
    ttl_s: float | None = None
    """``X-Session-TTL``: the TTL of a session this request creates (see ``request_ttl``)."""
    setup: Callable[[], None] | None = None
    """Runs under the store lock once the job is validated, before the engine starts it (a
    Responses chain's session is made here: nothing is written for a refused request)."""

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
            ttl_s=self.ttl_s,
            tools=self.tools,
            template_kwargs=self.template_kwargs,
            transient=self.stateless,
        )


def requested_session(
    request: Request, metadata: Mapping[str, str] | None, prompt_cache_key: str | None
) -> str | None:
    """The session a request names: ``X-Session-Id``, ``metadata.session_id``, or
    ``prompt_cache_key``; None for a stateless request."""
    session_id = request.headers.get("x-session-id") or (metadata or {}).get("session_id") or prompt_cache_key
    try:
        if session_id is not None:
            validate_session_id(session_id)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="X-Session-Id", code="invalid_value") from exc
    return session_id


def namespace_for(tenant: str, cache_salt: str | None) -> str:
    """The tenant's namespace, or with a ``cache_salt`` one of the tenant's own per salt (the
    salt hashed: a namespace is a name, the salt may be anything)."""
    if cache_salt is None:
        return tenant
    return f"{tenant}{SALT_SEPARATOR}{hashlib.sha256(cache_salt.encode()).hexdigest()[:32]}"


def request_priority(request: Request, service_tier: str | None) -> Priority:
    """``X-Priority``, else the class of OpenAI's ``service_tier`` (``flex``: background,
    ``priority``: realtime), else interactive."""
    header = request.headers.get("x-priority")
    if header is None:
        return _TIER_PRIORITY.get(service_tier or "", Priority.INTERACTIVE)
    try:
        return Priority.parse(header)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="X-Priority", code="invalid_value") from exc


def request_ttl(request: Request, default: float | None = None) -> float | None:
    """``X-Session-TTL`` (seconds), else ``default`` (``ServerConfig.session_ttl_s``): the TTL of
    a session the request creates, so that a session gc expired comes back with its TTL, not as
    one that never expires."""
    header = request.headers.get("x-session-ttl")
    if header is None:
        return default
    try:
        ttl_s = float(header)
    except ValueError:
        ttl_s = math.nan
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        message = "X-Session-TTL must be a positive number of seconds"
        raise APIError(400, message, param="X-Session-TTL", code="invalid_value")
    return ttl_s


def build_job(
    ctx: ServerContext,
    request: Request,
    body: GenerationParams,
    tenant: str,
    *,
    grammar: GrammarSpec | None,
    logprobs: bool,
    top_logprobs: int,
    whole_items: bool = False,
    session_id: str | None = None,
    named_by_request: bool = True,
    **prompt: Any,
) -> Job:
    """The job of ``body``, in the session the request names (or, without ``named_by_request``,
    in ``session_id``, None for a throwaway session)."""
    if not ctx.config.serves(body.model):
        raise APIError(
            404,
            f"model {body.model!r} is not served here; use {ctx.config.model_name!r}",
            param="model",
            code="model_not_found",
        )
    if body.stream_options is not None and not body.stream:
        message = "stream_options is only allowed when stream is true"
        raise APIError(400, message, param="stream_options", code="invalid_value")
    max_tokens = body.max_completion_tokens or body.max_tokens or ctx.config.default_max_tokens
    if max_tokens > ctx.config.max_tokens_limit:
        raise APIError(
            400,
            f"max_tokens must be <= {ctx.config.max_tokens_limit}",
            param="max_tokens",
            code="invalid_value",
        )
    if body.cache_salt is not None and tenant in ctx.config.api_keys.quotas:
        # a salted namespace is not the tenant's: its quota would not hold there
        raise APIError(400, "cache_salt is not available to a tenant with quotas", param="cache_salt")
    if named_by_request:
        session_id = requested_session(request, body.metadata, body.prompt_cache_key)
    priority = request_priority(request, body.service_tier)
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
            whole_items=whole_items,
            top_k=body.top_k,
            repetition_penalty=body.repetition_penalty,
            logit_bias=tuple((int(t), b) for t, b in (body.logit_bias or {}).items()),
        )
    except ConfigError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
    return Job(
        kind="chat" if "messages" in prompt else "text",
        session_id=session_id or f"{STATELESS_PREFIX}{uuid.uuid4().hex}",
        stateless=session_id is None,
        namespace=namespace_for(tenant, body.cache_salt),
        priority=priority,
        sampling=sampling,
        ttl_s=request_ttl(request, ctx.config.session_ttl_s),
        n=body.n,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        tokens_as_ids=body.return_tokens_as_token_ids,
        **prompt,
    )


def prepare(ctx: ServerContext, job: Job) -> list[GenerationRequest]:
    """The engine requests of ``job``'s choices; everything that can refuse the request runs
    here, before anything is written to the store."""
    if not job.stateless and not job.own_session and not ctx.config.create_sessions:
        with ctx.store_lock:
            ctx.store.session(job.session_id, job.namespace)  # SessionNotFoundError: a 404
    requests = [job.request(i) for i in range(job.n)]
    try:
        prompt_ids = ctx.engine.prompt_token_ids(requests[0])
    except (TypeError, ValueError) as exc:  # a chat template refusing its chat_template_kwargs
        raise APIError(400, f"the chat template failed: {exc}", param="chat_template_kwargs") from exc
    if len(prompt_ids) > ctx.config.max_prompt_tokens:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens; the most this server takes is "
            f"{ctx.config.max_prompt_tokens}",
            param="messages" if job.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    try:
        ctx.engine.decoder(requests[0])  # an invalid grammar or stop token: a 400 now, not mid-stream
    except ConfigError as exc:
        text = str(exc)
        param = next((p for p in ("stop_token_ids", "logit_bias") if p in text), None)
        raise APIError(400, text, param=param, code="invalid_value") from exc
    return requests


def set_up(ctx: ServerContext, job: Job) -> None:
    """The job's own preparation of the store (after :func:`prepare`, before the engine)."""
    if job.setup is not None:
        with ctx.store_lock:
            job.setup()


def finish(ctx: ServerContext, job: Job) -> None:
    """After the job's last choice has committed: a stateless job's session goes."""
    if job.stateless:
        with ctx.store_lock:
            ctx.store.delete_session(job.session_id, job.namespace)
            ctx.engine.forget(job.session_id, job.namespace)


def run_job(ctx: ServerContext, job: Job) -> list[Response]:
    """Run the job's choices in the engine's batch, one after the other (they share a session)."""
    single_threaded_torch()  # the batch computes; no OpenMP team here beside the step thread's
    gauge = ctx.metrics.in_flight.labels(job.priority.value)
    gauge.inc()
    try:
        requests = prepare(ctx, job)
        set_up(ctx, job)
        try:
            results = [ctx.engine.run(request) for request in requests]
        finally:
            finish(ctx, job)
    finally:
        gauge.dec()
    for response in results:
        ctx.metrics.observe(response, job.priority)
    return results


def echo_text(ctx: ServerContext, job: Job) -> str:
    """The prompt, which a completion with ``echo`` starts with ("" without echo)."""
    if not job.echo:
        return ""
    if job.prompt is not None:
        return job.prompt
    return str(ctx.engine.model.tokenizer.decode(list(job.prompt_ids or ())))


def api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, KVStrataError):
        return from_kvstrata(exc)
    raise exc


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
