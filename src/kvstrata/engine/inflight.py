"""One request on its way through the engine, and the handle its caller reads it from.

An :class:`InFlight` is created on the caller's thread (prompt tokenised, decoder built: a
request that cannot run is refused there, before anything is written), then passes through:

1. the session's queue (one request of a session at a time);
2. the step thread's batch: queued until the step scheduler admits it, which asks the store
   worker to restore its prefix (``OPENING``); once the row is ``READY``, the next step takes it;
3. decoding, one token per step, each handed to the caller's :class:`ResponseStream`;
4. the store worker again: commit of what it computed, then the future resolves.

Fields are written by one thread at a time, in that order; the hand-overs go through the
engine's queues and locks.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import queue
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvstrata.engine.batch import BatchRow
from kvstrata.engine.decoder import DecodeStep, RequestDecoder
from kvstrata.engine.prefix import Prefix
from kvstrata.engine.requests import GenerationRequest, Response
from kvstrata.store.sessions import Session


class RowState(enum.Enum):
    NEW = "new"
    OPENING = "opening"
    READY = "ready"
    TAKEN = "taken"
    FAILED = "failed"


class _End:
    """Put on a stream's queue after the last step: the response (or failure) is on the future."""


_END = _End()


@dataclass(eq=False)
class InFlight:
    request_id: str
    request: GenerationRequest
    prompt_ids: list[int]
    decoder: RequestDecoder
    streaming: bool
    """Whether a caller reads the steps (else they are not queued)."""
    submitted: float = field(default_factory=time.perf_counter)
    future: Future[Response] = field(default_factory=Future)
    steps: queue.SimpleQueue[DecodeStep | _End] = field(default_factory=queue.SimpleQueue)

    # the store worker, when it opens the row
    state: RowState = RowState.NEW
    session: Session | None = None
    prefix: Prefix | None = None
    row: BatchRow | None = None
    prefill: list[int] = field(default_factory=list)
    lease: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    failure: BaseException | None = None
    closed: bool = False
    """Finished before its row was opened: the store worker must not open it any more."""
    cancelled: bool = False
    """Its caller cancelled it (the step thread drops it, even if it has not joined the batch yet)."""
    realtime_paused_prefetch: bool = False
    saved: int = 0
    """Computed tokens (past the prefix) appended to the session so far: by the incremental
    checkpoints of the running request, then by its commit."""
    saving: bool = False
    """An incremental checkpoint of it is queued or running (the step thread asks for one at a time)."""
    save_error: BaseException | None = None
    """An incremental checkpoint failed to append: no more of them; the commit raises it."""
    awaited: bool = False
    """Another request waits for prompt blocks it computes: it saves them as soon as they are
    computed (:mod:`kvstrata.engine.computing`)."""
    waited_on: InFlight | None = None
    """The running request this one waited for (it may take that row's KV past the blocks saved)."""
    lent: tuple[int, torch.Tensor] | None = None
    """(first position, KV) of its own prompt tokens that ``waited_on``'s row computed past the
    full blocks the store gives: copied by the store worker when it reopened this request
    (:meth:`SessionJobs._lend <kvstrata.engine.session_jobs.SessionJobs._lend>`), taken by its open."""
    borrowed: int = 0
    """Prompt tokens whose KV its row took from ``waited_on``'s row, past its prefix (not prefilled)."""
    published: int = 0
    """Its row's length when the step thread last handed it to the store worker (an incremental
    checkpoint, or its end): the step thread never writes the row's positions before it again."""

    # the step thread
    admitted_at: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def session_key(self) -> tuple[str, str] | None:
        """The session this request changes (None: it uses no cache)."""
        if not self.request.use_cache:
            return None
        return (self.request.namespace, self.request.session_id)

    def computed_ids(self, begin: int, end: int) -> list[int]:
        """The token ids of the computed tokens ``begin:end`` past the prefix (the prompt's rest,
        then the generated tokens)."""
        assert self.prefix is not None
        rest = self.prompt_ids[self.prefix.num_tokens :]
        generated = self.decoder.token_ids[max(0, begin - len(rest)) : max(0, end - len(rest))]
        return rest[begin:end] + generated

    def pick(self, logits: torch.Tensor) -> int:
        """The step thread's token picker: choose, accept, hand the released text over."""
        choice = self.decoder.choose(logits)
        step = self.decoder.accept(choice)
        self.token_times.append(time.perf_counter())
        if self.streaming and (step.text or step.logprobs or step.finish_reason):
            self.steps.put(step)
        return choice.token

    def resolve(self, response: Response | None, failure: BaseException | None = None) -> None:
        """The end: the future gets the response (or the failure), the stream its end mark."""
        if failure is not None:
            self.future.set_exception(failure)
        else:
            self.future.set_result(response)  # type: ignore[arg-type]
        self.steps.put(_END)

    def timings(self, ended: float) -> dict[str, object]:
        """The response's timing fields."""
        times = self.token_times
        first = times[0] if times else None
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        return {
            "ttft_ms": (first - self.submitted) * 1e3 if first is not None else 0.0,
            "decode_tokens_per_s": (len(times) - 1) / decode_s if decode_s > 0 else 0.0,
            "total_ms": (ended - self.submitted) * 1e3,
            "queued_ms": ((self.admitted_at or ended) - self.submitted) * 1e3,
            "inter_token_ms": [(b - a) * 1e3 for a, b in itertools.pairwise(times)],
        }


class ResponseStream:
    """An iterator of text deltas (``steps()``: of :class:`DecodeStep` objects, with the tokens'
    log-probabilities and the finish); ``response`` is set once it is exhausted.

    The request runs in the engine's batch whether or not the stream is read; ``cancel()`` (or
    ``close()``, which also waits for the end) stops it at the next step, and the session keeps
    what it computed until then."""

    def __init__(self, inflight: InFlight, cancel: Callable[[InFlight], None]) -> None:
        self._inflight = inflight
        self._cancel = cancel
        self.response: Response | None = None

    @property
    def request_id(self) -> str:
        return self._inflight.request_id

    def __iter__(self) -> Iterator[str]:
        for step in self.steps():
            if step.text:
                yield step.text

    def steps(self) -> Iterator[DecodeStep]:
        """The request's steps as they come; raises the request's failure, if it failed."""
        while True:
            item = self._inflight.steps.get()
            if isinstance(item, _End):
                break
            yield item
        self.response = self._inflight.future.result()

    def result(self, timeout: float | None = None) -> Response:
        """Wait for the request's end; its response (the steps not read are dropped)."""
        self.response = self._inflight.future.result(timeout)
        return self.response

    def done(self) -> bool:
        """Whether the request has ended (finished, cancelled or failed: :meth:`result` says which)."""
        return self._inflight.future.done()

    def cancel(self) -> None:
        """Ask the engine to stop the request at its next step (returns at once; thread-safe)."""
        self._cancel(self._inflight)

    def close(self) -> None:
        """Cancel the request and wait until the engine is done with it (its session committed)."""
        if not self._inflight.future.done():
            self.cancel()
        futures.wait([self._inflight.future])
