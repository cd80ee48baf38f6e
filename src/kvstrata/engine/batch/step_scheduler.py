"""Which requests run in each step of a continuous batch (pure: no model, no I/O, no clock).

A request goes ``submit`` (queued, no KV yet) -> ``admit`` (live: its KV is restored and it has
``prefill_tokens`` prompt tokens to compute) -> a series of steps, in which it prefills in
chunks and then decodes one token per step -> ``finish``. Each step is one forward pass of the
batch; :meth:`StepScheduler.plan` chooses its rows, :meth:`StepScheduler.complete` records that
it ran. Time is counted in steps, so every rule below is deterministic and testable.

The rules, in the order a step is filled (up to ``max_sequences`` rows and ``max_tokens``
tokens, a decode costs one token, a prefill chunk its length):

1. **Starvation guard**: a live request that has not run for ``starvation_steps`` steps (or a
   queued one that has waited that long to be admitted) is *starving*. Up to
   ``starvation_slots`` starving interactive or background requests go first, ahead even of
   realtime ones, so a background request progresses at least once every ``starvation_steps``
   steps whatever the load (as long as there are no more starving requests than reserved slots
   per step; beyond that they take turns, longest waiting first). The other starving requests
   go right after the realtime ones.
2. **Realtime** requests: starving ones (realtime requests beyond the batch take turns), then
   decodes, then prefills. A realtime prefill is not cut into ``prefill_chunk`` pieces (only the
   step's token budget limits it), and realtime requests are admitted even above ``max_live``:
   a realtime arrival gets its prefill at the next step.
3. **Interactive**, then 4. **background**: decodes first (they keep their inter-token latency
   steady and cost one token each), then prefills in chunks of at most ``prefill_chunk`` tokens,
   first in, first served; while an interactive request prefills, background ones do not
   (``interactive_prefill_first``; the reserved starving row aside).
5. **Idle** requests (``submit(..., idle=True)``: the engine's recompute of an upgraded
   session's lossy blocks) run only in a step that holds nothing else, and are admitted one at
   a time, only when nothing else waits for admission; they never starve (waiting is what they
   are for). The plan of such a step says so (``StepPlan.idle``): the engine gives it up for any
   row that gets ready meanwhile.

While a realtime request is live, the rows of the lower classes are held to
``realtime_max_sequences`` / ``realtime_max_tokens`` (the realtime rows themselves to the full
budget), and join one step in ``realtime_share_every``: a step's cost grows with its rows, and a
realtime request's inter-token latency should stay near its unloaded one. While a realtime request
prefills (``realtime_prefill_alone``), the step holds nothing else but the starving requests'
reserved rows: its time to first token is then that of its prefill alone, and the others lose one
step. A live request that does not fit is *paused*: it keeps its KV (the engine may demote it) and
runs again when there is room; a paused request that ran in the previous step counts as a
preemption of its class.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstrata.errors import ConfigError
from kvstrata.priority import Priority


class Phase(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class StepBudget:
    """How much one step may hold, and the fairness knobs."""

    max_sequences: int = 16
    """Rows per step."""
    max_tokens: int = 512
    """Tokens per step: a decode row counts one, a prefill chunk its length."""
    prefill_chunk: int = 256
    """Most prompt tokens an interactive or background request prefills in one step."""
    max_live: int = 64
    """Requests that hold KV at once (running or paused); realtime ones may exceed it."""
    starvation_steps: int = 8
    """A live request runs at least once in every this many steps."""
    starvation_slots: int = 1
    """Rows per step reserved for starving requests, ahead of realtime ones."""
    realtime_max_sequences: int = 4
    """While a realtime request is live: rows per step for everything else, starving included."""
    realtime_max_tokens: int = 256
    """While a realtime request is live: tokens per step for everything else."""
    realtime_share_every: int = 1
    """While a realtime request is live, everything else runs in one step of every this many
    (1: every step). Where a row costs much (fp32 on a CPU), the realtime request's steps then
    stay as short as its own, but for the one that others share."""
    realtime_prefill_alone: bool = True
    """While a realtime request prefills: no other rows but the reserved starving ones."""
    interactive_prefill_first: bool = True
    """While an interactive request prefills, background ones do not (but the reserved starving
    one): a burst's interactive requests get their first token after their own prefills, not
    after the background requests' that arrived with them."""

    def __post_init__(self) -> None:
        for name in (
            "max_sequences",
            "max_tokens",
            "prefill_chunk",
            "max_live",
            "starvation_steps",
            "realtime_max_sequences",
            "realtime_max_tokens",
            "realtime_share_every",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"StepBudget.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.starvation_slots, int) or self.starvation_slots < 0:
            raise ConfigError(f"StepBudget.starvation_slots must be >= 0, got {self.starvation_slots!r}")
        if self.starvation_slots >= self.max_sequences:
            raise ConfigError("StepBudget.starvation_slots must leave at least one row for the others")
        if self.starvation_slots > self.realtime_max_sequences:
            # the reserved rows count among the other classes' rows while a realtime request runs
            raise ConfigError("StepBudget.starvation_slots must not exceed realtime_max_sequences")


@dataclass(frozen=True, slots=True)
class Slot:
    """A request's row in one step."""

    request_id: str
    priority: Priority
    phase: Phase
    tokens: int
    logits: bool
    """Whether the step yields the request's next-token logits (a decode, or a prefill chunk that
    ends the prompt)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    step: int
    slots: tuple[Slot, ...]
    paused: tuple[str, ...]
    """Live requests that ran in the previous step and are left out of this one (preempted)."""
    idle: bool = False
    """The step holds idle requests alone (rule 5): any row that gets ready may take its place."""

    @property
    def tokens(self) -> int:
        return sum(slot.tokens for slot in self.slots)

    @property
    def request_ids(self) -> list[str]:
        return [slot.request_id for slot in self.slots]


@dataclass(slots=True)
class _Entry:
    request_id: str
    priority: Priority
    order: int
    last_run: int
    """The step it last ran in (for a queued or just admitted request: the step before it was
    submitted), which the starvation guard measures from."""
    prefill_tokens: int | None = None
    """None while queued."""
    prefilled: int = 0
    idle: bool = False
    """Runs only in steps that hold nothing else (rule 5)."""

    @property
    def live(self) -> bool:
        return self.prefill_tokens is not None

    @property
    def phase(self) -> Phase:
        assert self.prefill_tokens is not None
        return Phase.PREFILL if self.prefilled < self.prefill_tokens else Phase.DECODE


@dataclass(slots=True)
class SchedulerCounts:
    """What the metrics report: queue depth, live requests and preemptions, per class."""

    queued: dict[Priority, int] = field(default_factory=dict)
    live: dict[Priority, int] = field(default_factory=dict)
    preemptions: dict[Priority, int] = field(default_factory=dict)


class StepScheduler:
    """Chooses each step's batch; see the module docstring for the rules."""

    def __init__(self, budget: StepBudget | None = None) -> None:
        self.budget = budget or StepBudget()
        self.step = 0
        self._entries: dict[str, _Entry] = {}
        self._order = itertools.count()
        self._ran_last: set[str] = set()
        self._pending: StepPlan | None = None
        self._held: tuple[Slot, ...] = ()
        """The slots of a paused step: no plan holds their requests until :meth:`resume_held`."""
        self._others_shared = -(1 << 62)
        """The last step a realtime request shared with rows of the other classes."""
        self.preemptions: dict[Priority, int] = {p: 0 for p in Priority}

    # -- requests coming and going -----------------------------------------------------------
    def submit(self, request_id: str, priority: Priority | str, *, idle: bool = False) -> None:
        """Queue a request; ``idle``: it runs only in steps that hold nothing else (rule 5)."""
        if request_id in self._entries:
            raise ConfigError(f"request {request_id!r} is already scheduled")
        self._entries[request_id] = _Entry(
            request_id, Priority.parse(priority), next(self._order), last_run=self.step - 1, idle=idle
        )

    def admissions(self) -> list[str]:
        """Queued requests to admit now (restore their KV, then :meth:`admit`), in order: every
        realtime one, then starving ones, interactive, background, up to ``max_live``."""
        queued = [e for e in self._entries.values() if not e.live and not e.idle]
        room = self.budget.max_live - sum(e.live for e in self._entries.values())
        if not queued:  # idle requests only when nobody else waits, one at a time (each holds a row)
            waiting = sorted((e for e in self._entries.values() if not e.live), key=lambda e: e.order)
            if not waiting or room < 1 or any(e.live and e.idle for e in self._entries.values()):
                return []
            return [waiting[0].request_id]
        chosen = [e for e in queued if e.priority is Priority.REALTIME]
        rest = sorted(
            (e for e in queued if e.priority is not Priority.REALTIME),
            key=lambda e: (not self._starving(e), e.priority.rank, e.order),
        )
        chosen += rest[: max(0, room - len(chosen))]
        return [e.request_id for e in sorted(chosen, key=lambda e: e.order)]

    def admit(self, request_id: str, prefill_tokens: int) -> None:
        """``request_id`` holds its KV now and has ``prefill_tokens`` (>= 1) prompt tokens to compute."""
        entry = self._get(request_id)
        if entry.live:
            raise ConfigError(f"request {request_id!r} is already admitted")
        if prefill_tokens < 1:
            raise ConfigError("a request prefills at least one token (its logits come from it)")
        entry.prefill_tokens = prefill_tokens

    def finish(self, request_id: str) -> None:
        """Forget ``request_id`` (done, cancelled or failed); unknown ids are ignored."""
        self._entries.pop(request_id, None)
        self._ran_last.discard(request_id)
        self._held = tuple(slot for slot in self._held if slot.request_id != request_id)

    # -- steps -------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The next step's rows (possibly none). :meth:`complete` must follow before the next plan."""
        if self._pending is not None:
            raise ConfigError("the previous plan was not completed")
        budget = self.budget
        held = {slot.request_id for slot in self._held}
        live = [e for e in self._entries.values() if e.live and not e.idle and e.request_id not in held]
        realtime_live = any(e.priority is Priority.REALTIME for e in live)
        share = self.step - self._others_shared >= budget.realtime_share_every
        realtime_prefill = budget.realtime_prefill_alone and any(
            e.priority is Priority.REALTIME and e.phase is Phase.PREFILL for e in live
        )
        interactive_prefill = budget.interactive_prefill_first and any(
            e.priority is Priority.INTERACTIVE and e.phase is Phase.PREFILL for e in live
        )
        starving = sorted(
            (e for e in live if e.priority is not Priority.REALTIME and self._starving(e)),
            key=lambda e: (e.last_run, e.order),
        )
        realtime = sorted(
            (e for e in live if e.priority is Priority.REALTIME),
            key=lambda e: (not self._starving(e), e.phase is Phase.PREFILL, e.order),
        )
        reserved = starving[: budget.starvation_slots]
        ordered = reserved + realtime + starving[budget.starvation_slots :]
        for cls in (Priority.INTERACTIVE, Priority.BACKGROUND):
            ordered += self._by_phase(e for e in live if e.priority is cls)
        slots: list[Slot] = []
        taken: set[str] = set()
        tokens = 0
        other_rows = other_tokens = 0  # rows of the lower classes (and starving ones)
        for entry in ordered:
            if entry.request_id in taken or len(slots) >= budget.max_sequences:
                continue
            is_realtime = entry.priority is Priority.REALTIME
            if realtime_prefill and not is_realtime and entry not in reserved:
                continue
            if (
                interactive_prefill
                and entry.priority is Priority.BACKGROUND
                and entry.phase is Phase.PREFILL
                and entry not in reserved
            ):
                continue
            room = budget.max_tokens - tokens
            if realtime_live and not is_realtime:
                if other_rows >= budget.realtime_max_sequences or not share:
                    continue
                room = min(room, budget.realtime_max_tokens - other_tokens)
            slot = self._slot(entry, room, chunked=entry.priority is not Priority.REALTIME)
            if slot is None:
                continue
            slots.append(slot)
            taken.add(entry.request_id)
            tokens += slot.tokens
            if not is_realtime:
                other_rows += 1
                other_tokens += slot.tokens
        idle_step = not slots
        if idle_step:  # a step with nothing else to run: the idle requests'
            idle = self._by_phase(e for e in self._entries.values() if e.live and e.idle)
            for entry in idle[: budget.max_sequences]:
                slot = self._slot(entry, budget.max_tokens - tokens, chunked=True)
                if slot is not None:
                    slots.append(slot)
                    tokens += slot.tokens
        paused = tuple(sorted(self._ran_last - taken, key=lambda rid: self._entries[rid].order))
        self._pending = StepPlan(self.step, tuple(slots), paused, idle=idle_step and bool(slots))
        return self._pending

    def complete(self, plan: StepPlan) -> None:
        """Record that ``plan`` ran: prefill progress, who ran, preemptions; the step count advances."""
        if plan is not self._pending:
            raise ConfigError("complete() takes the plan the last plan() returned")
        for slot in plan.slots:
            entry = self._entries.get(slot.request_id)
            if entry is None:  # finished during the step
                continue
            if slot.phase is Phase.PREFILL:
                entry.prefilled += slot.tokens
            entry.last_run = plan.step
        for request_id in plan.paused:
            entry = self._entries.get(request_id)
            if entry is not None:
                self.preemptions[entry.priority] += 1
        self._ran_last = {slot.request_id for slot in plan.slots if slot.request_id in self._entries}
        priorities = {slot.priority for slot in plan.slots}
        if Priority.REALTIME in priorities and len(priorities) > 1:
            self._others_shared = plan.step
        self._pending = None
        self.step += 1

    def abandon(self, plan: StepPlan) -> None:
        """The step of ``plan`` failed before running: nothing progressed, the step is not counted."""
        if plan is not self._pending:
            raise ConfigError("abandon() takes the plan the last plan() returned")
        self._pending = None

    def hold(self, plan: StepPlan, slots: Iterable[Slot]) -> None:
        """``plan``'s step was given up (not counted), ``slots`` paused: held until :meth:`resume_held`."""
        self.abandon(plan)
        self._held = tuple(slots)

    def resume_held(self) -> StepPlan:
        """The plan of the paused slots going on (:meth:`complete` or :meth:`hold` follows)."""
        if self._pending is not None:
            raise ConfigError("the previous plan was not completed")
        self._pending = StepPlan(self.step, self._held, ())
        self._held = ()
        return self._pending

    def release_held(self) -> tuple[Slot, ...]:
        """Forget the paused slots (their step was rolled back): their requests are planned again."""
        held, self._held = self._held, ()
        return held

    # -- introspection -----------------------------------------------------------------------
    def phase(self, request_id: str) -> Phase | None:
        """The request's phase; None while it is queued."""
        entry = self._get(request_id)
        return entry.phase if entry.live else None

    def idle_steps(self, request_id: str) -> int:
        """Steps since the request last ran (0: it ran in the last step)."""
        return self.step - 1 - self._get(request_id).last_run

    def counts(self) -> SchedulerCounts:
        counts = SchedulerCounts(
            queued={p: 0 for p in Priority}, live={p: 0 for p in Priority}, preemptions=dict(self.preemptions)
        )
        for entry in self._entries.values():
            (counts.live if entry.live else counts.queued)[entry.priority] += 1
        return counts

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # -- helpers -----------------------------------------------------------------------------
    def _get(self, request_id: str) -> _Entry:
        try:
            return self._entries[request_id]
        except KeyError:
            raise ConfigError(f"unknown request {request_id!r}") from None

    def _starving(self, entry: _Entry) -> bool:
        return not entry.idle and self.step - entry.last_run >= self.budget.starvation_steps

    @staticmethod
    def _by_phase(entries: Iterable[_Entry]) -> list[_Entry]:
        """Decoding requests first, then prefilling ones; first in, first served within each."""
        return sorted(entries, key=lambda e: (e.phase is Phase.PREFILL, e.order))

    def _slot(self, entry: _Entry, room: int, *, chunked: bool) -> Slot | None:
        if room < 1:
            return None
        if entry.phase is Phase.DECODE:
            return Slot(entry.request_id, entry.priority, Phase.DECODE, 1, True)
        assert entry.prefill_tokens is not None
        remaining = entry.prefill_tokens - entry.prefilled
        n = min(remaining, room, self.budget.prefill_chunk if chunked else remaining)
        return Slot(entry.request_id, entry.priority, Phase.PREFILL, n, n == remaining)
