"""The engine: many sessions' requests decode together, one forward pass per step.

A request goes through these steps (continuous batching; see :mod:`kvstrata.engine.batch`):

1. on the caller's thread: its prompt's token ids and its decoder (:mod:`.prompts`): a request
   that cannot run is refused here, before anything is written. One request per session runs at
   a time; a second one waits for the first to commit (:mod:`kvstrata.engine.scheduler`);
2. on the store worker: hold the session's lease, restore the longest stored prefix into the
   request's row (:mod:`kvstrata.engine.session_jobs`); a slow restore never stalls the batch;
3. on the step thread, which owns the model: every step, the step scheduler picks the rows (by
   class, chunked prefills, no starvation); one forward pass runs them all; each row's decoder
   picks its token (:mod:`kvstrata.engine.stepper`);
4. on the store worker again: an incremental checkpoint every ``checkpoint_every_tokens`` computed
   tokens while it runs, and at its end (finished or cancelled) the commit of the rest, so the
   session's tokens are exactly the tokens whose KV is stored; then the future resolves.

A single request is the batch of one: there is one decoding path. :meth:`Engine.drain` bounds a
stop (:mod:`kvstrata.engine.drain`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvstrata.engine.batch import BatchedForward, BatchLoop, BatchRow, StepBudget
from kvstrata.engine.budget import DEFAULT_MAX_BATCH, BatchStats, batch_budget
from kvstrata.engine.decoder import RequestDecoder
from kvstrata.engine.drain import DEFAULT_DRAIN_TIMEOUT_S, DrainReport, drain
from kvstrata.engine.grammar import GrammarCompiler
from kvstrata.engine.inflight import InFlight, ResponseStream, RowState
from kvstrata.engine.prefetch import Prefetcher
from kvstrata.engine.prompts import RequestPreparer
from kvstrata.engine.requests import GenerationRequest, Message, Response
from kvstrata.engine.scheduler import Admission
from kvstrata.engine.session_jobs import SessionJobs
from kvstrata.engine.stepper import Stepper, StepReport
from kvstrata.engine.upgrades import IdleRecomputes, PriorityChange
from kvstrata.engine.worker import PriorityWorker
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.model import LoadedModel
from kvstrata.integrations.transformers.packed_linear import pack_linears, pad_fp32_linears
from kvstrata.policy.memory import MemoryMode
from kvstrata.priority import Priority
from kvstrata.runtime import release_openmp_threads
from kvstrata.store import DEFAULT_NAMESPACE, KVStore

__all__ = ["BatchStats", "Engine", "GenerationRequest", "Response", "ResponseStream", "batch_budget"]

StreamCallback = Callable[[str], None]

# the store worker's order: a realtime request's restore first (its time to first token), then
# commits (they resolve requests and free their sessions) and interactive restores in arrival
# order (neither waits behind a stream of the other), then background restores: a restore goes at
# its class's rank (Priority.rank), a commit at the interactive one
_COMMIT_RANK = Priority.INTERACTIVE.rank


class Engine:
    """Runs requests for many sessions on one model, against one store, in one batch."""

    def __init__(
        self,
        model: LoadedModel,
        store: KVStore,
        *,
        queue_limit: int = 64,
        l1_resident_sessions: int = 4,
        track_importance: bool = False,
        memory_modes: Mapping[Priority | str, MemoryMode] | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        budget: StepBudget | None = None,
        attention: str = "sdpa",
        pack_weights: bool = True,
        share_prefixes: bool = True,
    ) -> None:
        """``l1_resident_sessions``: how many sessions' KV may stay in device memory between
        their requests (the least recently served beyond are demoted to L2). ``track_importance``:
        measure the attention mass each block receives, for the store's cost-based eviction.
        ``memory_modes``: lossy memory modes per class (off by default), e.g. ``{"background":
        MemoryMode("importance", 1024)}`` (:mod:`kvstrata.policy.memory`). ``max_batch``: the most
        requests in one forward pass (1: no batching); ``budget``: every knob of the step
        scheduler instead (:class:`StepBudget`). ``queue_limit``: the most requests waiting (not
        yet in a row); more get QueueFullError. ``attention``: ``sdpa`` or ``eager``.
        ``pack_weights``: pack bf16 linear weights for oneDNN once, pad fp32 linears' inputs of
        2-3 rows to 4 (same results within rounding, faster small steps on the CPU:
        :mod:`kvstrata.integrations.transformers.packed_linear`). ``share_prefixes``: wait for
        prompt blocks another request computes (:mod:`.computing`)."""
        modes = {Priority.parse(p): mode for p, mode in (memory_modes or {}).items()}
        layout = model.layout(store.layout.block_tokens)
        if layout != store.layout:
            raise ConfigError(f"the model's KV layout {layout} does not match the store's {store.layout}")
        if store.model_fingerprint != model.fingerprint:
            raise ConfigError("the store was opened with another model fingerprint than the model's")
        self.model = model
        self.store = store
        if pack_weights:
            pack_linears(model.model)  # bf16
            pad_fp32_linears(model.model)
        self.memory_modes = modes
        self.queue_limit = queue_limit
        self.budget = budget or batch_budget(max_batch, fp32=model.model.dtype == torch.float32)
        self._prepare = RequestPreparer(model)
        self.store_lock = threading.RLock()
        """Held by whatever uses the store's sessions: the engine's store worker, and callers
        beside the engine (the server's admin actions)."""
        self._jobs = SessionJobs(  # checks the memory modes
            model,
            store,
            l1_resident_sessions=l1_resident_sessions,
            track_importance=track_importance,
            memory_modes=modes,
            spare_buffers=max(2, self.budget.max_sequences),  # a burst restores into paged-in memory
            reopen=self._start_open if share_prefixes else None,
        )
        self._admission = Admission(queue_limit)
        self._worker = PriorityWorker("kvstrata-store", self.store_lock)
        loop = BatchLoop(BatchedForward(model.model, attention), self.budget)
        self._stepper = Stepper(loop, self._take_row, self._left_batch, self._progress)
        self._ids = itertools.count()
        self._inflight: dict[str, InFlight] = {}
        self._prefetcher: Any = None
        self._drain_lock = threading.Lock()
        self._drained: DrainReport | None = None
        self._upgrades = IdleRecomputes(store, self.store_lock, self._start, self._cancel)
        # loading the model left this thread an OpenMP team; freed, the step thread's team is the
        # only one and is not throttled (runtime.py: 15-20% of a batched fp32 step on 2 cores)
        release_openmp_threads()

    @property
    def l1_resident_sessions(self) -> int:
        return self._jobs.l1_resident_sessions

    # -- public API ------------------------------------------------------------------------------
    def chat(
        self,
        session_id: str,
        messages: Sequence[Message],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        namespace: str = DEFAULT_NAMESPACE,
        priority: Priority | str = Priority.INTERACTIVE,
        use_cache: bool = True,
        seed: int | None = None,
        stream: StreamCallback | None = None,
    ) -> Response:
        """Answer the conversation ``messages`` (the whole history, as the chat template takes it)."""
        request = GenerationRequest(
            session_id, messages=list(messages), max_new_tokens=max_new_tokens, temperature=temperature,
            namespace=namespace, priority=priority, use_cache=use_cache, seed=seed,
        )  # fmt: skip
        return self.run(request, stream=stream)

    def complete(
        self,
        session_id: str,
        prompt: str,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        namespace: str = DEFAULT_NAMESPACE,
        priority: Priority | str = Priority.INTERACTIVE,
        use_cache: bool = True,
        seed: int | None = None,
        stream: StreamCallback | None = None,
    ) -> Response:
        """Continue the raw text ``prompt`` (the whole text so far; no chat template)."""
        request = GenerationRequest(
            session_id, prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature,
            namespace=namespace, priority=priority, use_cache=use_cache, seed=seed,
        )  # fmt: skip
        return self.run(request, stream=stream)

    def stream(self, request: GenerationRequest) -> ResponseStream:
        """Start ``request``; iterate the stream over its text deltas as they come (the response
        is on the stream afterwards). ``cancel()`` / ``close()`` stop it."""
        return ResponseStream(self._start(request, streaming=True), self._cancel)

    def run(self, request: GenerationRequest, *, stream: StreamCallback | None = None) -> Response:
        """Run ``request`` to its end (in the batch with whatever else runs); ``stream`` gets each
        text delta as it comes."""
        handle = ResponseStream(self._start(request, streaming=stream is not None), self._cancel)
        try:
            if stream is None:
                return handle.result()
            for step in handle.steps():
                if step.text:
                    stream(step.text)
        except BaseException:
            handle.cancel()  # an interrupted caller: the request stops at its next step
            raise
        assert handle.response is not None
        return handle.response

    def submit(self, request: GenerationRequest) -> Future[Response]:
        """Start ``request`` and return a future of its :class:`Response`; its session's blocks
        are prefetched into device memory meanwhile. Raises :class:`QueueFullError` when
        ``queue_limit`` requests are waiting already."""
        inflight = self._start(request, streaming=False)
        if request.use_cache:
            self.hint([request.session_id], request.namespace)  # a queued request prefetches itself
        return inflight.future

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles the grammars of constrained requests (built on first use: about 0.3 s)."""
        return self._prepare.grammars

    def decoder(self, request: GenerationRequest, prompt_ids: Sequence[int] = ()) -> RequestDecoder:
        """The per-request decoding state of ``request`` (``prompt_ids``: what a repetition penalty
        counts); raises :class:`ConfigError` for a request that cannot run."""
        return self._prepare.decoder(request, prompt_ids)

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as token ids (the chat template rendered, or the text tokenised)."""
        return self._prepare.prompt_token_ids(request)

    # -- requests through the threads ------------------------------------------------------------
    def _start(self, request: GenerationRequest, *, streaming: bool = False) -> InFlight:
        prompt_ids = self.prompt_token_ids(request)
        decoder = self.decoder(request, prompt_ids)  # may refuse the request: before anything is written
        inflight = InFlight(f"req-{next(self._ids)}", request, prompt_ids, decoder, streaming)
        inflight.future.set_running_or_notify_cancel()  # it runs from here on: not cancellable so
        if request.use_cache and not request.idle:  # the session's idle recompute yields to it
            self._upgrades.arrived(request.session_id, request.namespace)
        ready = self._admission.enter(inflight)  # QueueFullError
        self._inflight[inflight.request_id] = inflight
        if ready:
            self._to_batch(inflight)
        return inflight

    def _to_batch(self, inflight: InFlight) -> None:
        """Hand ``inflight`` to the step thread; its restore starts now where the next step admits
        it anyway (realtime: whatever the load, the running step given up for it; else while the
        requests in flight fit in one step), not a step later."""
        request = inflight.request
        fits = len(self._inflight) <= self.budget.max_sequences and not request.idle
        if request.priority is Priority.REALTIME or fits:
            self._start_open(inflight)
        self._stepper.submit(inflight)

    def _start_open(self, inflight: InFlight) -> None:
        inflight.state = RowState.OPENING
        self._worker.submit(Priority(inflight.request.priority).rank, lambda: self._open(inflight))

    def _take_row(self, inflight: InFlight) -> tuple[BatchRow, list[int]] | None:
        """The step thread admits the request: its row once restored (None until then)."""
        if inflight.state is RowState.NEW:
            self._start_open(inflight)
            return None
        if inflight.state is not RowState.READY:
            return None
        assert inflight.row is not None
        inflight.state = RowState.TAKEN
        inflight.admitted_at = time.perf_counter()
        self._admission.started(inflight)
        return inflight.row, inflight.prefill

    def _open(self, inflight: InFlight) -> None:
        """Store worker: restore the request's prefix into its row."""
        if inflight.closed:
            return  # it ended while its restore waited
        realtime = inflight.request.priority is Priority.REALTIME
        try:
            if self._jobs.wait_for_prefix(inflight):
                return  # opened again once a running request saved the prompt blocks it computes
            self._jobs.open(inflight)
        except Exception as exc:  # the request's failure: its future raises it
            inflight.failure = exc
            inflight.state = RowState.FAILED
            self._stepper.finish(inflight, "error")
            return
        if realtime and self._prefetcher is not None:
            self._prefetcher.realtime_started()  # background loading pauses meanwhile
            inflight.realtime_paused_prefetch = True
        inflight.state = RowState.READY
        self._stepper.wake(None if inflight.request.idle else Priority(inflight.request.priority))

    def _left_batch(self, inflight: InFlight, reason: str) -> None:
        """Step thread: the request left the batch; its commit goes to the store worker."""
        self._worker.submit(_COMMIT_RANK, lambda: self._commit(inflight, reason))

    def _progress(self, running: list[InFlight]) -> None:
        """Step thread: post the incremental checkpoints that are due (session_jobs.py)."""
        if due := self._jobs.take_due(running):
            self._worker.submit(_COMMIT_RANK, lambda: self._jobs.save_running(due))

    def _commit(self, inflight: InFlight, reason: str) -> None:
        """Store worker: persist what the request computed, release its session, resolve it."""
        inflight.closed = True  # a restore still queued for it is skipped
        self._jobs.ended(inflight)  # its waiters look again: its blocks are saved now (or never)
        failure = inflight.failure
        response = None
        try:
            if failure is None:
                self._jobs.commit(inflight)
                response = self._jobs.response(inflight, reason, time.perf_counter())
        except Exception as exc:  # the commit failed: the request fails with it
            failure = exc
        finally:
            try:
                inflight.lease.close()  # a failed request's uncommitted changes are dropped here
            finally:
                if inflight.realtime_paused_prefetch:
                    self._prefetcher.realtime_finished()
                inflight.row = None  # its KV is in the store now (or dropped): free the buffers
                self._end(inflight, response, failure)

    def _cancel(self, inflight: InFlight) -> None:
        """Stop ``inflight`` at its next step (any thread); a request still waiting for its
        session ends at once, having computed nothing."""
        if inflight.future.done():
            return
        if self._admission.withdraw(inflight):
            self._end(inflight, self._jobs.response(inflight, "cancelled", time.perf_counter()), None)
            return
        inflight.cancelled = True
        self._stepper.finish(inflight, "cancelled")

    def _end(self, inflight: InFlight, response: Response | None, failure: BaseException | None) -> None:
        self._inflight.pop(inflight.request_id, None)
        self._upgrades.ended(inflight)
        following = self._admission.leave(inflight)
        inflight.resolve(response, failure)
        if following is not None:
            self._to_batch(following)

    # -- the batch -------------------------------------------------------------------------------
    def add_step_listener(self, listener: Callable[[StepReport], None], *, logits: bool = False) -> None:
        """Call ``listener`` after every step, on the step thread (keep it short); ``logits``:
        the reports carry the logits each token was picked from (tests compare them)."""
        self._stepper.listeners.append(listener)
        self._stepper.record_logits = self._stepper.record_logits or logits

    def batch_stats(self) -> BatchStats:
        stepper = self._stepper
        return BatchStats.of(
            stepper.counts, self._admission.behind_sessions(), stepper.steps, stepper.interrupted_steps
        )

    def busy(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        """Whether a request of the session is running or waiting."""
        return self._admission.busy(session_id, namespace)

    # -- sessions --------------------------------------------------------------------------------
    def set_priority(
        self, session_id: str, priority: Priority | str, namespace: str = DEFAULT_NAMESPACE
    ) -> PriorityChange:
        """Change the session's class now; when it rises, its lossy blocks are made exact before
        its next request (:mod:`kvstrata.engine.upgrades`: from L3 or in idle engine steps)."""
        return self._upgrades.set_priority(session_id, priority, namespace)

    def forget(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Drop a deleted (or throwaway) session from the residency list, so that it does not
        push live sessions out of device memory."""
        with self.store_lock:
            self._jobs.forget(session_id, namespace)

    def request_rate(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> float:
        """The session's request rate (requests/s), an exponential moving average; 0 if unknown."""
        return self._jobs.request_rate(session_id, namespace)

    def hint(self, next: Sequence[str], namespace: str = DEFAULT_NAMESPACE) -> None:
        """Say which sessions run next: their blocks are loaded into device memory meanwhile."""
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self.store)
        self._prefetcher.hint(list(next), namespace)

    def drain(self, timeout_s: float | None = DEFAULT_DRAIN_TIMEOUT_S) -> DrainReport:
        """Take no more requests, and give the ones in flight ``timeout_s`` in all to finish and
        save what they computed (None: no bound; see :mod:`kvstrata.engine.drain`). Once only: a
        later call waits for the first one and returns its report."""
        with self._drain_lock:
            if self._drained is None:
                self._admission.closed = True
                self._upgrades.cancel_all()  # idle work stops at once (keeping what it computed)
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                self._drained = drain(list(self._inflight.values()), self._cancel, deadline)
            return self._drained

    def close(self, timeout_s: float | None = None) -> DrainReport:
        """:meth:`drain` (without a bound unless ``timeout_s``, or within the bound of an earlier
        drain), then stop the engine's threads. When the report is not ``complete`` (requests
        still saving at the deadline), they are left to run: the caller must not close the store
        under them."""
        report = self.drain(timeout_s)
        if report.complete:
            self._stepper.stop()
            self._worker.stop()
            if self._prefetcher is not None:
                self._prefetcher.close()
                self._prefetcher = None
        return report
