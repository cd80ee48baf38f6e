"""The routes of the Responses API: ``POST /v1/responses`` (streaming or not), ``GET`` and
``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A request is run as the chat request it amounts to (:func:`objects.chat_request`: the
conversation as chat messages, the same tools, grammar and sampling) in the session its chain
lives in (:mod:`records`); a stored response is written once the engine committed its KV, and
before the client is told it is complete, so a continuation sent at once finds both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvstrata.errors import KVStrataError
from kvstrata.server import responses
from kvstrata.server.chat import prepare_chat
from kvstrata.server.context import ServerContext
from kvstrata.server.deps import context, locked, require_tenant
from kvstrata.server.errors import APIError
from kvstrata.server.jobs import (
    Job,
    api_error,
    build_job,
    extension,
    headers,
    namespace_for,
    requested_session,
    run_job,
)
from kvstrata.server.responses_api import records
from kvstrata.server.responses_api.events import EventStream
from kvstrata.server.responses_api.items import Item, chat_messages, input_items, new_id, output_items
from kvstrata.server.responses_api.objects import chat_request, response_object, status_of
from kvstrata.server.responses_api.schemas import ResponsesRequest
from kvstrata.server.schemas import ChatCompletionRequest
from kvstrata.server.streaming import start_job, stream_error

router = APIRouter(prefix="/v1/responses")


@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """A Responses request made ready: its job, and what its response and record need."""

    body: ResponsesRequest
    job: Job
    response_id: str
    created_at: int
    placement: records.Placement
    context: list[Item]

    def response(
        self, ctx: ServerContext, status: str, output: list[Item], result: Any = None
    ) -> dict[str, Any]:
        return response_object(
            self.body,
            self.response_id,
            self.created_at,
            model=ctx.config.model_name,
            status=status,
            output=output,
            result=result,
            extension=extension(self.job, result) if result is not None else None,
        )

    async def save(self, ctx: ServerContext, response: dict[str, Any]) -> None:
        session_id = self.placement.session_id
        if self.body.store and session_id is not None:
            record = records.Record(session_id, response, self.context)
            await locked(ctx, lambda: records.save(ctx, self.job.namespace, record))


async def _prepare(ctx: ServerContext, request: Request, body: ResponsesRequest, tenant: str) -> _Run:
    if body.background:
        raise APIError(
            400, "background responses are not supported", param="background", code="unsupported_value"
        )
    if body.conversation is not None:
        raise APIError(
            400, "conversations are not supported: continue with previous_response_id", param="conversation"
        )
    namespace = namespace_for(tenant, body.cache_salt)
    previous = None
    if body.previous_response_id is not None:
        previous_id = body.previous_response_id
        previous = await locked(ctx, lambda: records.find(ctx, namespace, previous_id))
        if previous is None:
            raise records.not_found(previous_id, "previous_response_id")
    history = previous.history() if previous is not None else []
    items = input_items(body.input, history)
    if not items:
        raise APIError(400, "input: give at least one input item", param="input", code="invalid_value")
    context_items = [*history, *items]
    chat_body = _chat_body(body, context_items)
    chat = prepare_chat(chat_body, ctx.engine.model.tokenizer)
    response_id = new_id("resp")
    named = requested_session(request, body.metadata, body.prompt_cache_key)
    placement = await locked(
        ctx, lambda: records.place(ctx, namespace, previous, named, store=body.store, response_id=response_id)
    )
    job = build_job(
        ctx,
        request,
        chat_body,
        tenant,
        grammar=chat.grammar,
        logprobs=chat_body.logprobs,
        top_logprobs=chat_body.top_logprobs or 0,
        whole_items=chat.whole_items,
        session_id=placement.session_id,
        named_by_request=False,
        messages=chat.messages,
        tools=chat.template_tools,
        reads_calls=chat.reads_calls,
        own_session=placement.new_chain or placement.fork_from is not None,
    )
    priority, ttl_s = job.priority.value, ctx.config.response_ttl_s
    job = dataclasses.replace(
        job, setup=lambda: records.make_session(ctx, job.namespace, placement, priority, ttl_s)
    )
    return _Run(body, job, response_id, int(time.time()), placement, context_items)


def _chat_body(body: ResponsesRequest, items: list[Item]) -> ChatCompletionRequest:
    return chat_request(body, chat_messages(body.instructions, items))


@router.post("", response_model=None)
async def create_response(
    body: ResponsesRequest, request: Request, tenant: str = Depends(require_tenant)
) -> JSONResponse | StreamingResponse:
    ctx = context(request)
    run = await _prepare(ctx, request, body, tenant)
    if body.stream:
        return await _stream(ctx, run)
    try:
        (result,) = await run_in_threadpool(run_job, ctx, run.job)
    except (APIError, KVStrataError) as exc:
        raise api_error(exc) from exc
    status = status_of(result)
    output = output_items(result.text, reads_calls=run.job.reads_calls, status=status)
    text_of = run.job.token_text(ctx.engine.model.tokenizer)
    if text_of is not None and result.logprobs is not None and output[0]["type"] == "message":
        output[0]["content"][0]["logprobs"] = responses.chat_logprobs(result.logprobs, text_of)["content"]
    response = run.response(ctx, status, output, result)
    try:
        await run.save(ctx, response)
    except KVStrataError as exc:
        raise api_error(exc) from exc
    return JSONResponse(response, headers=headers(run.job))


async def _stream(ctx: ServerContext, run: _Run) -> StreamingResponse:
    events = await start_job(ctx, run.job)
    stream = EventStream(
        reads_calls=run.job.reads_calls, text_of=run.job.token_text(ctx.engine.model.tokenizer)
    )

    async def body() -> AsyncIterator[str]:
        for line in stream.started(run.response(ctx, "in_progress", [])):
            yield line
        result = None
        try:
            while True:
                kind, value = await events.get()
                if kind == "step":
                    for line in stream.step(value[1]):
                        yield line
                elif kind == "choice":
                    result = value[1]
                    for line in stream.finish(result, status_of(result)):
                        yield line
                elif kind == "done":
                    assert result is not None
                    status = status_of(result)
                    response = run.response(ctx, status, stream.output, result)
                    await run.save(ctx, response)
                    kind = "response.completed" if status == "completed" else "response.incomplete"
                    yield stream.event(kind, response=response)
                    return
                else:  # "fail": the status line went out, so the error is an event
                    raise value
        except (APIError, KVStrataError) as exc:
            error = stream_error(exc)
            yield stream.event("error", code=error.code, message=error.message, param=error.param)
        finally:
            events.cancel()  # a no-op once the job is done

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers(run.job))


async def _stored(request: Request, tenant: str, response_id: str, cache_salt: str | None) -> records.Record:
    ctx = context(request)
    namespace = namespace_for(tenant, cache_salt)
    try:
        record = await locked(ctx, lambda: records.find(ctx, namespace, response_id))
    except KVStrataError as exc:
        raise api_error(exc) from exc
    if record is None:
        raise records.not_found(response_id)
    return record


@router.get("/{response_id}")
async def get_response(
    response_id: str,
    request: Request,
    tenant: str = Depends(require_tenant),
    cache_salt: str | None = Query(default=None),
) -> dict[str, Any]:
    return (await _stored(request, tenant, response_id, cache_salt)).response


@router.delete("/{response_id}")
async def delete_response(
    response_id: str,
    request: Request,
    tenant: str = Depends(require_tenant),
    cache_salt: str | None = Query(default=None),
) -> dict[str, Any]:
    ctx = context(request)
    namespace = namespace_for(tenant, cache_salt)
    if not await locked(ctx, lambda: records.delete(ctx, namespace, response_id)):
        raise records.not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    tenant: str = Depends(require_tenant),
    cache_salt: str | None = Query(default=None),
    after: str | None = Query(default=None),
    limit: int = Query(default=20, ge=1, le=100),
    order: str = Query(default="desc", pattern="^(asc|desc)$"),
) -> dict[str, Any]:
    """The items the model saw before the response's output (its chain's history included),
    newest first by default, as OpenAI pages them."""
    items = (await _stored(request, tenant, response_id, cache_salt)).context
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
