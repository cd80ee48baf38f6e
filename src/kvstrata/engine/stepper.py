"""The step thread: owns the model and the batch, and runs one forward pass per step.

Other threads talk to it through an inbox: requests to add (:meth:`Stepper.submit`), requests to
end (:meth:`Stepper.finish`: cancelled by their caller, or failed while their row was restored)
and wake-ups (:meth:`Stepper.wake`: a row is ready). Between steps it applies them, then runs
:meth:`BatchLoop.step`, so a row always holds exactly its prompt and generated tokens but the
last. Each request's decoder picks its tokens inside the step (:meth:`InFlight.pick`); a decoder
that reports a stop (a stop string, a grammar that is complete) ends its request right after
the step. Finished requests go to ``on_finished`` (the engine commits them on its store worker);
after each step, the requests that ran and go on go to ``on_progress`` (the engine's incremental
checkpoints: it only posts them to its store worker).

While a step of lower-class rows runs, a request of a more demanding class whose row became ready
gives that step up (:class:`StepInterrupted`, at the next layer), so its prefill runs at once
instead of after a whole step of other sessions. The step's interactive and background prefill
rows pause where they were and go on right after the next step
(:mod:`kvstrata.engine.batch.pause`): nothing of their work is lost; its other rows lose that
step's time.

The thread starts with the first request and ends once the batch has been empty for
``IDLE_THREAD_S`` (:mod:`kvstrata.runtime`: a thread per request cost each request a new OpenMP
team) or the engine closes (:meth:`Stepper.stop`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstrata.engine.batch import (
    BatchLoop,
    BatchRow,
    LoopRequest,
    SchedulerCounts,
    StepInterrupted,
    StepPlan,
)
from kvstrata.engine.inflight import InFlight
from kvstrata.priority import Priority
from kvstrata.runtime import IDLE_THREAD_S

log = logging.getLogger(__name__)

GATHER_S = 0.05
"""With an empty batch, how long the step thread waits for the rows still being restored after
the last one opened (or after the burst arrived) before its first step. A burst of requests (a
client fanning out, a server's first seconds) then starts in one step: without the wait the first
restored row ran alone, the next step took the few restored meanwhile, and so on (SmolLM2, 16
sessions: steps of 1, 7, 15 rows before all 16; each step costs nearly as much as a full one).
The wait ends as soon as every row is open, the batch is full or a realtime row is open, when no
row opened for ``GATHER_S``, and at ``GATHER_MAX_S`` after the burst arrived in any case; rows
already running are never held back by it. (A fixed 50 ms from the arrival was too short for 16
fp32 restores, about 3.5 ms each on one store worker: the first step held 14 or 15 rows, and one
step more per burst cost 6% of its throughput.)"""
GATHER_MAX_S = 0.25


@dataclass(slots=True)
class _Gathering:
    """The step thread's wait for a burst's rows: when it began, and when a row last opened."""

    started: float
    progress: float
    opened: int = 0


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step, as the engine's step listeners see it (on the step thread: keep them short)."""

    plan: StepPlan
    seconds: float
    interrupted: bool = False
    """The step was given up for a realtime arrival (nothing of it counts)."""
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per request id, the logits its token was picked from this step (with ``record_logits``)."""


RowOpener = Callable[[InFlight], tuple[BatchRow, list[int]] | None]
Finished = Callable[[InFlight, str], None]
Progress = Callable[[list[InFlight]], None]


class Stepper:
    def __init__(
        self, loop: BatchLoop, open_row: RowOpener, on_finished: Finished, on_progress: Progress | None = None
    ) -> None:
        """``open_row(inflight)``: the request's row and the prompt tokens left to compute, or
        None while it is being restored (see :class:`LoopRequest`). ``on_finished(inflight,
        reason)``: the request left the batch (its row holds what it computed).
        ``on_progress(inflights)``: after a step, the requests that ran in it and go on (keep it
        short: it runs on the step thread)."""
        self.loop = loop
        self.open_row = open_row
        self.on_finished = on_finished
        self.on_progress = on_progress
        self.listeners: list[Callable[[StepReport], None]] = []
        self.record_logits = False
        self.counts = SchedulerCounts()
        """The step scheduler's counts after the last step (read by the metrics)."""
        self.steps = 0
        self.interrupted_steps = 0
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, InFlight, str]] = []
        self._woken = False
        self._urgent: Priority | None = None
        """The most demanding class of the rows that got ready since the step began."""
        self._live: dict[str, InFlight] = {}
        self._thread: threading.Thread | None = None
        self._idle = True  # nothing submitted is unfinished
        self._stopping = False
        self.gather_s = GATHER_S
        self.gather_max_s = GATHER_MAX_S
        self._gather: _Gathering | None = None

    # -- from other threads ----------------------------------------------------------------------
    def submit(self, inflight: InFlight) -> None:
        with self._cond:
            self._post("submit", inflight, "")

    def finish(self, inflight: InFlight, reason: str) -> None:
        """End the request between steps (``cancelled``; ``error`` when its row failed to open)."""
        with self._cond:
            self._post("finish", inflight, reason)

    def wake(self, ready: Priority | None = None) -> None:
        """A row became ready; ``ready``: its class, for which a running step of less demanding rows
        alone is given up (see :meth:`_interrupt`)."""
        with self._cond:
            self._woken = True
            if ready is not None and (self._urgent is None or ready.rank < self._urgent.rank):
                self._urgent = ready
            self._cond.notify_all()

    def _post(self, kind: str, inflight: InFlight, reason: str) -> None:
        self._inbox.append((kind, inflight, reason))
        self._idle = self._stopping = False
        self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstrata-steps", daemon=True)
            self._thread.start()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``) until every request submitted has finished."""
        with self._cond:
            return self._cond.wait_for(lambda: self._idle, timeout)

    def stop(self) -> None:
        """Wait until idle, then let the step thread end now rather than after ``IDLE_THREAD_S``
        (the engine closes; a later submit starts a new one)."""
        with self._cond:
            self._cond.wait_for(lambda: self._idle)
            self._stopping = True
            self._cond.notify_all()

    # -- the step thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here: fail what is in the batch rather than hang it
            log.exception("the step thread failed")
            for inflight in list(self._live.values()):
                inflight.failure = inflight.failure or exc
                self.loop.finish(inflight.request_id, "error")
                self._done(inflight, "error")
            with self._cond:
                self._thread = None
                self._idle = not self._inbox
                if self._inbox:  # requests posted meanwhile get a fresh thread
                    self._thread = threading.Thread(target=self._run, name="kvstrata-steps", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
            raise

    def _loop(self) -> None:
        with torch.inference_mode():
            waiting = False  # the last step ran nothing: every request waits for its row
            while True:
                with self._cond:
                    while not self._inbox and not self._woken and (waiting or not self.loop.pending):
                        if not self.loop.pending:
                            self._gather = None  # (a burst that never opened a row)
                            self._idle = True
                            self._cond.notify_all()
                            if not self._linger():
                                return
                            continue
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, []
                    self._woken, self._urgent = False, None
                for kind, inflight, reason in inbox:
                    if kind == "submit":
                        self._add(inflight)
                    else:
                        self._end(inflight, reason)
                if self._gather_rows() or self._inbox:
                    continue  # a request came or went meanwhile: take it in first
                waiting = not self._step()

    def _linger(self) -> bool:
        """Wait (holding ``_cond``) for the next request, at most ``IDLE_THREAD_S``; False when
        none came (or the engine closes): the thread ends, and the next submit starts a new one."""
        self._cond.wait_for(lambda: self._inbox or self._woken or self._stopping, IDLE_THREAD_S)
        if self._inbox or self._woken:
            return True
        self._thread = None
        return False

    def _add(self, inflight: InFlight) -> None:
        if inflight.cancelled:  # cancelled while it was handed over: it never joins
            self.on_finished(inflight, "cancelled")
            return
        request = inflight.request
        self._live[inflight.request_id] = inflight
        self.loop.submit(
            LoopRequest(
                inflight.request_id,
                inflight.prompt_ids,
                request.params.max_tokens,
                priority=request.priority,
                pick=inflight.pick,
                open_row=lambda: self.open_row(inflight),
                idle=request.idle,
            )
        )

    def _end(self, inflight: InFlight, reason: str) -> None:
        if self.loop.finish(inflight.request_id, reason) is not None:
            self._done(inflight, reason)

    def _done(self, inflight: InFlight, reason: str) -> None:
        self._live.pop(inflight.request_id, None)
        self.on_finished(inflight, reason)

    def _gather_rows(self) -> bool:
        """With an empty batch, wait (see ``GATHER_S``) while rows are still being restored; True
        when the inbox got something meanwhile (the caller applies it, then asks again: the wait
        goes on where it was)."""
        loop = self.loop
        if not loop.pending or self.gather_s <= 0:
            self._gather = None
            return False
        now = time.perf_counter()
        if self._gather is None:
            if loop.open_rows:  # rows are running: not the start of a burst
                return False
            self._gather = _Gathering(started=now, progress=now)
        gathering = self._gather
        full = loop.scheduler.budget.max_sequences
        while True:
            with self._cond:
                if self._inbox:  # arrivals first: a realtime one posted meanwhile is admitted before
                    return True  # the lower classes whose rows got ready while it waited in the inbox
            loop.admit()
            opened = loop.open_rows
            now = time.perf_counter()
            if opened > gathering.opened:
                gathering.opened, gathering.progress = opened, now
            deadline = min(gathering.progress + self.gather_s, gathering.started + self.gather_max_s)
            remaining = deadline - now
            if opened >= min(loop.pending, full) or loop.realtime_open or remaining <= 0:
                self._gather = None
                return False
            with self._cond:
                if self._inbox:
                    return True
                if not self._woken:
                    self._cond.wait(remaining)
                self._woken = False

    def _interrupt(self, plan: StepPlan) -> bool:
        """Give the running step up for a row that got ready meanwhile when every row in it is of a
        less demanding class (a realtime row: any step without a realtime row; an interactive one: a
        step of background rows alone), or the step runs idle requests: the ready row's first token
        comes a step sooner: its interactive and background prefill rows pause (they go on after
        the next step, their finished layers kept), its other rows run again from where they were.

        Tried and not kept (2026-12-07, ``kvstrata bench agents --pool``): also giving up a step that
        holds a less demanding prefill beside other rows (the prefill pausing, the rest rolled
        back): hot P99 1.03x alone at 12 agents, but 2.90x at 20 and the background P99 about 3x.
        Nor (5d8c4e5, reverted) the same only while no other step was paused and never for a step
        holding an interactive prefill: pooled over six runs at 12 agents the hot P99 stayed where
        it was (173 against 175 ms) and the background P99 doubled; the hot tail there is each
        first turn slowed by the load, not a step it could give up (docs/benchmarks/pool.md)."""
        urgent = self._urgent
        if urgent is None:
            return False
        return plan.idle or all(slot.priority.rank > urgent.rank for slot in plan.slots)

    def _step(self) -> bool:
        """Run one step; whether it ran any row."""
        started = time.perf_counter()
        try:
            result = self.loop.step(self._interrupt)
        except StepInterrupted:
            self.interrupted_steps += 1
            self._report(StepReport(self.loop.last_plan, time.perf_counter() - started, interrupted=True))
            return True
        except Exception as exc:  # a failed forward pass: its rows were rolled back; they fail
            log.exception("a batch step failed")
            for slot in self.loop.last_plan.slots:
                inflight = self._live.get(slot.request_id)
                if inflight is not None:
                    inflight.failure = exc
                    self._end(inflight, "error")
            return True
        seconds = time.perf_counter() - started
        self.steps += 1
        logits: dict[str, torch.Tensor] = {}
        if self.record_logits:
            logits = {r.request_id: row for (r, _), row in zip(result.tokens, result.logits, strict=True)}
        for loop_request in result.finished:
            inflight = self._live[loop_request.request_id]
            if loop_request.failure is not None and inflight.failure is None:
                inflight.failure = loop_request.failure
            self._done(inflight, loop_request.finish_reason or "error")
        for loop_request, _ in result.tokens:
            inflight = self._live.get(loop_request.request_id)
            if inflight is not None and inflight.decoder.finished:
                self._end(inflight, "stop")  # a stop string or a complete grammar
        if self.on_progress is not None:
            going_on = [self._live[rid] for rid in result.plan.request_ids if rid in self._live]
            if going_on:
                self.on_progress(going_on)
        self.counts = self.loop.scheduler.counts()
        self._report(StepReport(result.plan, seconds, logits=logits))
        return bool(result.plan.slots)

    def _report(self, report: StepReport) -> None:
        for listener in self.listeners:
            try:
                listener(report)
            except Exception:  # an observer's bug must not stop the batch
                log.exception("a step listener failed")
