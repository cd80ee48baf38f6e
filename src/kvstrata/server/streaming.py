"""Streaming a job as server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``).

A worker thread reads the request's steps from the engine (where it decodes in the batch with
every other request) and hands them to the event loop through a queue. A request refused before
it starts is an HTTP error (400, 404, 429 when the engine's queue is full, ...); one that fails
after the status line went out ends with an error event. A client that leaves cancels its
request at the engine's next step: its session is committed up to the tokens computed by then
(the prompt, and the answer so far), never half-written.

Chat chunks carry ``delta.content``; with tools, calls are read out of the text as it streams
(:class:`~kvstrata.server.call_stream.CallStream`) and sent as ``delta.tool_calls``: a call's id
and name first, then its arguments as the model writes them, as OpenAI and vLLM stream them.
Text that could still turn out to be a stop string or the start of a call is held back until it
is known not to be. The thread and its events (:func:`start_job`) serve the Responses API's
streaming too (:mod:`kvstrata.server.responses_api`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvstrata.engine.decoder import DecodeStep
from kvstrata.engine.engine import Response, ResponseStream
from kvstrata.errors import KVStrataError
from kvstrata.runtime import single_threaded_torch
from kvstrata.server import responses
from kvstrata.server.call_stream import ArgumentsDelta, CallStart, CallStream, Event
from kvstrata.server.context import ServerContext
from kvstrata.server.errors import APIError, from_kvstrata
from kvstrata.server.jobs import (
    Job,
    api_error,
    echo_text,
    extension,
    finish,
    headers,
    prepare,
    set_up,
    total_usage,
)
from kvstrata.server.tools import ToolCall


class _Control:
    """How the response (on the event loop) stops the job's thread: the stream of the running
    choice is cancelled at once, and no further choice starts."""

    def __init__(self) -> None:
        self.cancelled = False
        self.current: ResponseStream | None = None

    def cancel(self) -> None:
        self.cancelled = True
        current = self.current
        if current is not None:
            current.cancel()

    def start(self, stream: ResponseStream) -> None:
        self.current = stream
        if self.cancelled:  # cancelled while the stream was being started
            stream.cancel()


def _generate_in_thread(
    ctx: ServerContext, job: Job, emit: Callable[[str, Any], None], control: _Control
) -> None:
    """Run the job, emitting ("error", exc) if it is refused before it starts, or ("start",),
    then per choice ("step", (index, DecodeStep))... and ("choice", (index, Response)), then
    ("done", None) or ("fail", exc). Every exit emits, so the response waiting on these events
    never hangs."""
    single_threaded_torch()  # the batch computes; no OpenMP team here beside the step thread's
    gauge = ctx.metrics.in_flight.labels(job.priority.value)
    gauge.inc()
    started = False
    try:
        requests = prepare(ctx, job)
        set_up(ctx, job)
        try:
            stream = ctx.engine.stream(requests[0])  # a full queue is still an HTTP error (429)
            started = True
            emit("start", None)
            for index, request in enumerate(requests):
                if index:
                    stream = ctx.engine.stream(request)
                control.start(stream)
                for step in stream.steps():
                    emit("step", (index, step))
                response = stream.response
                assert response is not None
                ctx.metrics.observe(response, job.priority)
                if control.cancelled:
                    # the client left: the session keeps what was computed until then
                    emit("fail", APIError(499, "the client closed the stream", type="server_error"))
                    return
                if response.finish_reason == "cancelled":  # the server's drain cut it (a stop)
                    emit("fail", APIError(503, "the server is stopping", type="server_error"))
                    return
                emit("choice", (index, response))
        finally:
            finish(ctx, job)  # after the engine committed: a stateless session goes
        emit("done", None)
    except (APIError, KVStrataError) as exc:
        emit("fail" if started else "error", exc)
    except Exception as exc:
        # not ours: the client gets a 500 (or an error event), and the worker's log the trace
        emit("fail" if started else "error", exc)
        raise
    finally:
        gauge.dec()


class _Chunks:
    """Builds the job's chunks (``data: ...`` lines)."""

    def __init__(self, ctx: ServerContext, job: Job) -> None:
        self.job = job
        self.chat = job.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = ctx.config.model_name
        self.text_of = job.token_text(ctx.engine.model.tokenizer)
        self.calls: dict[int, CallStream] = {}
        self.streamed_calls: set[str] = set()  # ids of calls whose header went out as a delta
        self.text_offset: dict[int, int] = {}
        self.echo = echo_text(ctx, job)

    def line(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return f"data: {_json({**body, 'choices': choices, **extra})}\n\n"

    def begin(self, index: int) -> list[str]:
        if not self.chat:
            if not self.echo:
                return []
            return [self.line([{"index": index, "text": self.echo, "logprobs": None, "finish_reason": None}])]
        if self.job.reads_calls:
            self.calls[index] = CallStream()
        delta = {"role": "assistant", "content": ""}
        return [self.line([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])]

    def step(self, index: int, step: DecodeStep) -> list[str]:
        logprobs = None
        if step.logprobs and self.text_of is not None:
            if self.chat:
                logprobs = responses.chat_logprobs(step.logprobs, self.text_of)
            else:
                offset = self.text_offset.get(index, 0)
                logprobs = responses.text_logprobs(step.logprobs, self.text_of, offset)
                self.text_offset[index] = offset + sum(len(t) for t in logprobs["tokens"])
        if not self.chat:
            if not step.text and logprobs is None:
                return []
            choice = {"index": index, "text": step.text, "logprobs": logprobs, "finish_reason": None}
            return [self.line([choice])]
        parser = self.calls.get(index)
        items: list[Event] = list(parser.feed(step.text)) if parser is not None else [step.text]
        return self._deltas(index, [i for i in items if i], logprobs)

    def end(self, index: int, response: Response) -> list[str]:
        lines: list[str] = []
        parser = self.calls.get(index)
        if parser is not None:
            lines += self._deltas(index, [i for i in parser.close() if i], None)
        calls = parser.calls if parser is not None else []
        final = {
            "index": index,
            "finish_reason": responses.finish_reason(response, calls),
            "stop_reason": response.stop_reason,
            "logprobs": None,
        }
        final.update({"delta": {}} if self.chat else {"text": ""})
        return [*lines, self.line([final])]

    def _deltas(self, index: int, items: list[Event], logprobs: dict[str, Any] | None) -> list[str]:
        parser = self.calls.get(index)
        lines = []
        for item in items:
            if isinstance(item, CallStart):
                self.streamed_calls.add(item.id)
                function = {"name": item.name, "arguments": ""}
                call = {"index": item.index, "id": item.id, "type": "function", "function": function}
                delta: dict[str, Any] = {"tool_calls": [call]}
            elif isinstance(item, ArgumentsDelta):
                delta = {"tool_calls": [{"index": item.index, "function": {"arguments": item.text}}]}
            elif isinstance(item, ToolCall):
                if item.id in self.streamed_calls:
                    continue  # its arguments went out as they came
                assert parser is not None
                delta = {"tool_calls": [item.to_openai(parser.calls.index(item))]}
            else:
                delta = {"content": item}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            lines.append(self.line([choice]))
            logprobs = None  # once per step
        if logprobs is not None:  # the step's text is held back; its tokens' logprobs are not
            choice = {"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": None}
            lines.append(self.line([choice]))
        return lines


class JobEvents:
    """The events of a job running on its own thread (see :func:`_generate_in_thread`):
    ("start", None) was read already; then ("step", (index, DecodeStep)), ("choice", (index,
    Response)), and ("done", None) or ("fail", exception)."""

    def __init__(self, queue: asyncio.Queue[tuple[str, Any]], control: _Control) -> None:
        self._queue = queue
        self._control = control

    async def get(self) -> tuple[str, Any]:
        return await self._queue.get()

    def cancel(self) -> None:
        """Stop the job at its next step (a no-op once it is done)."""
        self._control.cancel()


async def start_job(ctx: ServerContext, job: Job) -> JobEvents:
    """Start ``job`` on a thread of its own; an :class:`APIError` if it is refused before it
    starts (the response's status line is then still to be chosen)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    control = _Control()

    def emit(kind: str, value: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (kind, value))

    # A thread of its own: it waits on the engine for the whole stream, and the event loop's
    # default executor (a few threads per core) would hold concurrent streams back behind it.
    worker = threading.Thread(
        target=_generate_in_thread, args=(ctx, job, emit, control), name="kvstrata-stream", daemon=True
    )
    worker.start()
    kind, value = await events.get()
    if kind == "error":
        raise api_error(value)
    return JobEvents(events, control)


async def stream_job(ctx: ServerContext, job: Job) -> Any:
    from fastapi.responses import StreamingResponse

    events = await start_job(ctx, job)
    chunks = _Chunks(ctx, job)

    async def body() -> AsyncIterator[str]:
        results: list[Response] = []
        begun: set[int] = set()
        try:
            while True:
                kind, value = await events.get()
                if kind in ("step", "choice") and value[0] not in begun:
                    begun.add(value[0])
                    for line in chunks.begin(value[0]):
                        yield line
                if kind == "step":
                    for line in chunks.step(*value):
                        yield line
                elif kind == "choice":
                    results.append(value[1])
                    for line in chunks.end(*value):
                        yield line
                elif kind == "done":
                    if job.include_usage:
                        yield chunks.line([], usage=total_usage(results), kvstrata=extension(job, results[0]))
                    break
                else:  # "fail": the status line is sent already, so the error is an event
                    yield f"data: {_json(stream_error(value).body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            events.cancel()  # a no-op once the job is done

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers(job))


def stream_error(exc: Exception) -> APIError:
    """The error a stream ends with (the status line went out already)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, KVStrataError):
        return from_kvstrata(exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
