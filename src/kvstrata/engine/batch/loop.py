"""The step loop of continuous batching: admit requests, run each step's rows in one forward
pass, hand each row's logits to its request's token picker, finish requests.

It knows nothing of the store, the tokenizer or HTTP: the engine gives each request a
``open_row`` callback (restore the session's prefix from the store and say which prompt tokens
remain to compute), a ``pick`` callback (its per-request decoder: one logits row in, one token
out), and takes finished requests back to commit their rows' KV. A request's row holds, when it
finishes, the KV of the tokens it was built with, its prompt and every generated token but the
last (never fed to the model), exactly what the single-request engine commits.

``open_row`` may also answer "not yet" (None): the engine restores a session's KV on another
thread, so that a slow restore never stalls the batch; the request stays queued and is asked
again at the next step.

Failures stay per request where they can: a row that cannot be opened, whose tokens would pass
the model's positions, or whose ``pick`` raises (a grammar that allows nothing) finishes that
request with ``finish_reason == "error"`` (``error`` says why, ``failure`` is the exception). A
forward pass that raises leaves every row as it was before the step (the forward pass rolls its
appends back) and propagates; so does a step given up through ``interrupt``
(:class:`~kvstrata.engine.batch.forward.StepInterrupted`), which counts as not run; but its
interactive and background prefill rows pause where they were (:mod:`.pause`): held out of the
next step, they go on right after it (or at once if it holds no row). One step is paused at a
time: a step given up while another waits is rolled back whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstrata.engine.batch.forward import BatchedForward, BatchRow, Segment
from kvstrata.engine.batch.pause import PausedStep, StepPaused
from kvstrata.engine.batch.step_scheduler import Phase, StepBudget, StepPlan, StepScheduler
from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.priority import Priority

PickFn = Callable[[torch.Tensor], int]
RowOpener = Callable[[], tuple[BatchRow, Sequence[int]] | None]


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


@dataclass(eq=False)
class LoopRequest:
    """One request in the loop, and what it produced so far."""

    request_id: str
    prompt_ids: Sequence[int]
    """The tokens to feed when ``open_row`` is not given (the row then starts empty)."""
    max_new_tokens: int
    priority: Priority | str = Priority.INTERACTIVE
    pick: PickFn = greedy
    stop_ids: frozenset[int] = frozenset()
    open_row: RowOpener | None = None
    """Called at admission: the row (its cache holding what is already computed) and the prompt
    tokens still to feed (at least one); or None when the row is not ready yet (asked again at
    the next step)."""
    record_logits: bool = False
    """Keep every next-token logits row (tests compare them)."""
    idle: bool = False
    """Run only in steps that hold nothing else (:class:`StepScheduler`'s rule 5)."""

    row: BatchRow | None = None
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    failure: Exception | None = None
    """What made the request fail (with ``finish_reason == "error"``)."""
    _prefill: list[int] = field(default_factory=list)
    _fed: int = 0

    def __post_init__(self) -> None:
        self.priority = Priority.parse(self.priority)
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be >= 1")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class StepResult:
    plan: StepPlan
    tokens: list[tuple[LoopRequest, int]]
    """The tokens picked in this step, one per request that got logits, in row order."""
    logits: list[torch.Tensor]
    """The logits each of ``tokens`` was picked from."""
    finished: list[LoopRequest]
    """Requests that finished in this step (by a stop token, max_new_tokens or an error)."""


class BatchLoop:
    """Runs continuous batching steps over one :class:`BatchedForward`."""

    def __init__(self, forward: BatchedForward, budget: StepBudget | None = None) -> None:
        self.forward = forward
        self.scheduler = StepScheduler(budget)
        self._requests: dict[str, LoopRequest] = {}
        self._failed: list[LoopRequest] = []
        """Requests whose row failed to open in :meth:`admit`, reported by the next step."""
        self.last_plan = StepPlan(-1, (), ())
        """The plan of the last step run or tried (a step that raised names its rows here)."""
        self._paused: PausedStep | None = None
        self._resume_due = False
        """A step ran since the paused one was given up: it goes on next."""

    def submit(self, request: LoopRequest) -> None:
        if request.request_id in self._requests:
            raise ConfigError(f"request {request.request_id!r} is already in the loop")
        self.scheduler.submit(request.request_id, request.priority, idle=request.idle)
        self._requests[request.request_id] = request

    def finish(self, request_id: str, reason: str) -> LoopRequest | None:
        """End a request between steps (a stop string matched, the client went away); returns it
        (its row, if it was admitted, holds the KV to commit), or None if it is not in the loop."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        paused = self._paused
        if paused is not None and request.row is not None and any(r is request.row for r in paused.rows):
            self._drop_paused()  # the whole paused step rolls back: its other rows run it again
        self.scheduler.finish(request_id)
        if request.finish_reason is None:
            request.finish_reason = reason
        return request

    @property
    def pending(self) -> int:
        return len(self._requests)

    @property
    def open_rows(self) -> int:
        """Requests whose row is open (admitted: in the batch)."""
        return sum(request.row is not None for request in self._requests.values())

    @property
    def realtime_open(self) -> bool:
        return any(r.row is not None and r.priority is Priority.REALTIME for r in self._requests.values())

    def admit(self) -> None:
        """Admit what can be admitted now (each step does this first); a request whose row fails
        to open finishes with an error, reported by the next step."""
        self._failed += self._admit()

    def step(self, interrupt: Callable[[StepPlan], bool] | None = None) -> StepResult:
        """Admit what can be admitted, run one step, pick the tokens. ``interrupt(plan)`` is
        asked during the forward pass whether to give the step up (see
        :meth:`BatchedForward.forward`)."""
        self.admit()
        finished, self._failed = self._failed, []
        if self._paused is not None and self._resume_due:
            return self._resume(interrupt, finished)
        plan = self.last_plan = self.scheduler.plan()
        if not plan.slots and self._paused is not None:
            self.scheduler.abandon(plan)
            return self._resume(interrupt, finished)
        segments: list[Segment] = []
        for slot in plan.slots:
            request = self._requests[slot.request_id]
            assert request.row is not None
            if slot.phase is Phase.PREFILL:
                chunk = request._prefill[request._fed : request._fed + slot.tokens]
                request._fed += slot.tokens
            else:
                chunk = [request.generated[-1]]
            segments.append(Segment(request.row, chunk, slot.logits))
        check = (lambda: interrupt(plan)) if interrupt is not None else None
        # one paused step at a time: a step given up while another waits rolls back whole
        pausable = [
            self._paused is None and s.phase is Phase.PREFILL and s.priority is not Priority.REALTIME
            for s in plan.slots
        ]
        try:
            logits = self.forward.forward(segments, check, pausable) if segments else []
        except BaseException as exc:
            self._failed = finished + self._failed  # reported by the next step
            held = exc.paused if isinstance(exc, StepPaused) else None
            rows = set() if held is None else {id(row) for row in held.rows}
            for slot, segment in zip(plan.slots, segments, strict=True):
                if slot.phase is Phase.PREFILL and id(segment.row) not in rows:
                    self._requests[slot.request_id]._fed -= slot.tokens
            if held is None:
                self.scheduler.abandon(plan)
            else:
                self.scheduler.hold(
                    plan, [s for s, g in zip(plan.slots, segments, strict=True) if id(g.row) in rows]
                )
                self._paused, self._resume_due = held, False
            raise
        self.scheduler.complete(plan)
        self._resume_due = self._paused is not None
        return self._picked(plan, logits, finished)

    def _resume(
        self, interrupt: Callable[[StepPlan], bool] | None, finished: list[LoopRequest]
    ) -> StepResult:
        """The paused step goes on (:meth:`BatchedForward.resume`); given up again, it stays paused."""
        paused = self._paused
        assert paused is not None
        plan = self.last_plan = self.scheduler.resume_held()
        check = (lambda: interrupt(plan)) if interrupt is not None else None
        try:
            logits = self.forward.resume(paused, check)
        except StepPaused:
            self._failed = finished + self._failed
            self.scheduler.hold(plan, list(plan.slots))
            self._resume_due = False
            raise
        except BaseException:
            self._failed = finished + self._failed
            self._paused = None  # resume() rolled its rows back
            for slot in plan.slots:
                self._requests[slot.request_id]._fed -= slot.tokens
            self.scheduler.abandon(plan)
            raise
        self._paused, self._resume_due = None, False
        self.scheduler.complete(plan)
        return self._picked(plan, logits, finished)

    def _drop_paused(self) -> None:
        """Roll the paused step back whole (a request of it is ending): its rows run it again."""
        paused, self._paused, self._resume_due = self._paused, None, False
        assert paused is not None
        paused.roll_back()
        for slot in self.scheduler.release_held():
            request = self._requests.get(slot.request_id)
            if request is not None:
                request._fed -= slot.tokens

    def _picked(
        self, plan: StepPlan, logits: Sequence[torch.Tensor | None], finished: list[LoopRequest]
    ) -> StepResult:
        """Each slot's token picked from its logits; the requests that finished."""
        tokens: list[tuple[LoopRequest, int]] = []
        picked_from: list[torch.Tensor] = []
        for slot, row_logits in zip(plan.slots, logits, strict=True):
            if row_logits is None:
                continue
            request = self._requests[slot.request_id]
            try:
                token = request.pick(row_logits)
            except Exception as exc:  # the request's own picker (its grammar, its tokenizer): its failure
                request.error, request.failure = str(exc), exc
                finished.append(self._end(request, "error"))
                continue
            if request.record_logits:
                request.logits.append(row_logits.clone())
            request.generated.append(token)
            tokens.append((request, token))
            picked_from.append(row_logits)
            if token in request.stop_ids:
                finished.append(self._end(request, "stop"))
            elif len(request.generated) >= request.max_new_tokens:
                finished.append(self._end(request, "length"))
        return StepResult(plan, tokens, picked_from, finished)

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self._requests:
            self.step()

    def _admit(self) -> list[LoopRequest]:
        failed: list[LoopRequest] = []
        limit = self.forward.max_positions
        for request_id in self.scheduler.admissions():
            request = self._requests[request_id]
            try:
                if request.open_row is not None:
                    opened = request.open_row()
                    if opened is None:
                        continue  # restoring elsewhere: asked again at the next step
                    row, prefill = opened
                else:
                    row, prefill = BatchRow.empty(self.forward.model), request.prompt_ids
                prefill = [int(t) for t in prefill]
                if not prefill:
                    raise ConfigError("a request needs at least one prompt token to compute")
                # the last generated token is never fed: it needs no position
                last = row.next_position + len(prefill) + request.max_new_tokens - 1
                if limit is not None and last > limit:
                    raise ConfigError(f"the request would reach position {last}, past the model's {limit}")
            except KVStrataError as exc:
                request.error, request.failure = str(exc), exc
                failed.append(self._end(request, "error"))
                continue
            request.row, request._prefill, request._fed = row, prefill, 0
            self.scheduler.admit(request_id, len(prefill))
        return failed

    def _end(self, request: LoopRequest, reason: str) -> LoopRequest:
        ended = self.finish(request.request_id, reason)
        assert ended is request
        return request
