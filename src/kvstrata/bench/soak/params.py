"""What ``kvstrata bench soak`` is given, its targets (issue 32, acceptance 1) and what it records
as it runs (the run: :mod:`.runner`, the report: :mod:`.report`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.bench.common.measure import check_positive
from kvstrata.errors import ConfigError

CLASSES = ("realtime", "interactive", "background")
"""Agents take these classes in turn: agent i is ``CLASSES[i % 3]``."""
PERIOD_S = {"realtime": 2.0, "interactive": 5.0, "background": 15.0}
"""Seconds between an agent's turns, per class (``--pace`` scales them)."""
CHECKED_CLASS = "realtime"
"""Replies checked against a recompute: the realtime class keeps its KV exact in every tier (the
default ladder compresses the other classes' older blocks, so their replies may differ by design)."""

TARGETS = {
    "rss_mb_per_hour": 1.0,
    "fragmentation": 0.2,
    "ttft_p99_last_over_first": 1.2,
}
"""After warm-up RSS grows by at most 1 MB/hour; L3 fragmentation under 20%; TTFT p99 of the last
window within 1.2x of the first. Also: open files and threads flat, the data files within the L3
budget on disk, 0 failed requests, 0 wrong replies."""


@dataclass(frozen=True, slots=True)
class SoakParams:
    duration_s: float = 7200.0
    agents: int = 12
    max_turns: int = 12
    """Turns of a conversation before the agent starts a new session (the old one is left to its
    TTL, or deleted)."""
    max_tokens: int = 8
    pace: float = 1.0
    """Multiplies every class's period between turns (2 s, 5 s, 15 s)."""
    ttl_s: float = 120.0
    """TTL of the background agents' sessions: abandoned ones expire and gc deletes them."""
    fork_every: int = 4
    """Every this many turns, an interactive agent forks its session, takes a turn on the fork
    and deletes it."""
    check_every: int = 5
    """Every this many turns of a realtime agent, the reply is recomputed by the same server for a
    tenant with nothing cached, and compared token by token."""
    gc_every_s: float = 600.0
    restart_every_s: float = 1800.0
    kill_every: int = 3
    """Every this many restarts is a ``kill -9`` (the others a SIGTERM)."""
    sample_every_s: float = 30.0
    warmup_s: float = 600.0
    """After each (re)start, samples this young are warm-up: left out of the slopes."""
    window_s: float = 1800.0
    """TTFT p99 of the first and the last window of this length are compared."""
    l3_budget_bytes: int = 512 << 20
    l1_budget_bytes: int = 64 << 20
    l2_budget_bytes: int = 128 << 20
    model: str | None = None
    memwatch: bool = False
    """Have the server sample what it holds (:mod:`kvstrata.server.memwatch`) at every sample."""
    classes: tuple[str, ...] = field(default=CLASSES)

    def __post_init__(self) -> None:
        check_positive(
            duration=self.duration_s,
            agents=self.agents,
            max_turns=self.max_turns,
            max_tokens=self.max_tokens,
            pace=self.pace,
            ttl=self.ttl_s,
            fork_every=self.fork_every,
            check_every=self.check_every,
            gc_every=self.gc_every_s,
            restart_every=self.restart_every_s,
            kill_every=self.kill_every,
            sample_every=self.sample_every_s,
            window=self.window_s,
            l3_budget=self.l3_budget_bytes,
        )
        if self.warmup_s < 0:
            raise ConfigError("--warmup must be >= 0")
        if 2 * self.window_s > self.duration_s:
            raise ConfigError("--window must be at most half of --duration (a first and a last window)")


@dataclass(slots=True)
class Turn:
    """One request an agent made."""

    t_s: float
    """Seconds since the run started, when it was sent."""
    agent: int
    cls: str
    kind: str
    """``turn``, ``fork`` (a turn on a fork) or ``check`` (the recompute of a checked turn)."""
    ok: bool
    ttft_s: float | None = None
    error: str | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(slots=True)
class Check:
    """A realtime reply against its recompute."""

    t_s: float
    agent: int
    verdict: str
    """``same``, ``tie`` (they part where the recompute's top two tokens are within
    ``TIE_LOGPROB``: a rounding difference, not a wrong reply) or ``wrong``."""
    detail: str = ""


@dataclass(slots=True)
class Sample:
    """The server process and the store at one moment."""

    t_s: float
    segment: int
    """Which start of the server (0: the first; each restart or kill -9 begins a new one)."""
    age_s: float
    """Seconds since this segment's server started."""
    rss_bytes: int
    open_files: int
    threads: int
    data_bytes: int
    """Allocated bytes (st_blocks) of the store's block files and segments."""
    data_apparent_bytes: int
    index_bytes: int
    l3_live_bytes: int
    l3_fragmentation_bytes: int
    page_cache_bytes: int
    """The store's files' pages resident in the page cache."""
    sessions: int
    memory_tier_bytes: int = 0
    """What L1 and L2 hold, slot slack included (``/metrics``): caches filling up to their
    budgets grow RSS by this much, and that is no leak."""


@dataclass(slots=True)
class Events:
    """What the run did besides turns."""

    restarts: int = 0
    kills: int = 0
    gc_runs: int = 0
    gc_sessions_deleted: int = 0
    gc_blocks_deleted: int = 0
    gc_failures: list[str] = field(default_factory=list)
    forks: int = 0
    ttl_sessions: int = 0
    start_s: list[float] = field(default_factory=list)
    """Seconds each server start took (the first included)."""
    segment_starts_s: list[float] = field(default_factory=list)
    """When each start of the server began serving (seconds since the run started)."""
