"""What ``kvstrata bench trace`` is given and what one policy's replay records (the replay:
:mod:`.runner`, the tables: :mod:`.report`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.bench.common.measure import check_positive, percentile
from kvstrata.bench.common.models import TinyShape
from kvstrata.errors import ConfigError

KVSTRATA = "kvstrata (cost + ladder)"
"""The default policy: each class held in its codec in device memory too (encoded L1, issue 33)."""
KVSTRATA_EXACT_L1 = "kvstrata, exact L1"
"""The default policy with every class held exact in device memory (L2 and L3 as the ladder says)."""
PLAIN_LRU = "plain LRU (exact)"
TIERS = ("L1", "L2", "L3")


@dataclass(frozen=True, slots=True)
class TraceParams:
    trace: Path | None = None
    window: int = 3000
    sample_every: int = 12
    max_blocks: int = 12
    block_tokens: int = 16
    time_scale: float = 50.0
    memory_fraction: float = 0.25
    l1_share: float = 0.5
    seed: int = 0
    l3_budget: float | None = None
    """L3's budget as a fraction of the slice's unique KV bytes (full precision); None: unbounded."""
    model: str | None = None
    tiny: TinyShape = field(default_factory=TinyShape)
    policies: tuple[str, ...] = (KVSTRATA, KVSTRATA_EXACT_L1, PLAIN_LRU)
    repeats: int = 1
    """Replays of the slice per policy, the policies' order rotated each time (the first replay of a
    process is not the one that runs first); the percentiles are over every repeat's requests."""
    interleave: int = 30
    """Requests each policy replays before the next policy takes its turn, through the whole slice
    (the order rotated each round): the machine's drift over a replay of some 20 s then falls on
    every policy alike. 0: each policy replays the whole slice in turn."""
    warmup: int = 30
    """Requests of the slice replayed once under each policy, untimed, on a throwaway store, before
    the measured replays: the engine's first requests of each prompt shape build its kernels."""

    def __post_init__(self) -> None:
        check_positive(
            repeats=self.repeats,
            window=self.window,
            sample_every=self.sample_every,
            max_blocks=self.max_blocks,
            block_tokens=self.block_tokens,
            time_scale=self.time_scale,
            memory_fraction=self.memory_fraction,
        )
        if self.interleave < 0:
            raise ConfigError(f"--interleave must be 0 or more requests, got {self.interleave}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be 0 or more requests, got {self.warmup}")
        if self.l3_budget is not None:
            check_positive(l3_budget=self.l3_budget)
        if not 0.0 < self.l1_share < 1.0:
            raise ConfigError(f"--l1-share must lie strictly between 0 and 1, got {self.l1_share}")
        unknown = set(self.policies) - {KVSTRATA, KVSTRATA_EXACT_L1, PLAIN_LRU}
        if unknown:
            raise ConfigError(f"unknown policies {sorted(unknown)}")


@dataclass(slots=True)
class Replayed:
    index: int
    blocks: int
    hit_blocks: int
    hits_by_tier: dict[str, int]
    prompt_tokens: int
    prefill_tokens: int
    ttft_ms: float
    lag_s: float
    repeat: int = 0


@dataclass(slots=True)
class PolicyRun:
    policy: str
    requests: list[Replayed]
    wall_s: float
    peak_bytes: dict[str, int]
    final_bytes: dict[str, int]
    bytes_by_codec: dict[str, dict[str, int]] = field(default_factory=dict)
    writes: dict[str, Any] = field(default_factory=dict)
    """Failed requests (and the first error), L3 evictions and write failures."""
    sessions: dict[str, Any] = field(default_factory=dict)
    """The kept sessions, reloaded after the replay: readable, cut (recomputed from a token), errors."""
    failed_blocks: int = 0
    """Trace blocks of the requests that failed: counted as misses (their reply, and what it reused,
    was lost with the error)."""

    @property
    def blocks(self) -> int:
        return sum(r.blocks for r in self.requests) + self.failed_blocks

    @classmethod
    def merged(cls, repeats: list[PolicyRun]) -> PolicyRun:
        """One policy's repeats as one run: every request, the counts added up, the mean wall time,
        the peaks' maximum, and what the last repeat's store held at its end."""
        if len(repeats) == 1:
            return repeats[0]
        last = repeats[-1]
        return cls(
            last.policy,
            [request for run in repeats for request in run.requests],
            sum(run.wall_s for run in repeats) / len(repeats),
            {tier: max(run.peak_bytes[tier] for run in repeats) for tier in last.peak_bytes},
            last.final_bytes,
            last.bytes_by_codec,
            _added([run.writes for run in repeats]),
            _added([run.sessions for run in repeats]),
            sum(run.failed_blocks for run in repeats),
        )

    @property
    def hit_blocks(self) -> int:
        return sum(r.hit_blocks for r in self.requests)

    def hits_by_tier(self) -> dict[str, int]:
        return {t: sum(r.hits_by_tier.get(t, 0) for r in self.requests) for t in TIERS}

    def ttft(self, q: float) -> float:
        return percentile([r.ttft_ms for r in self.requests], q)

    def summary(self, block_tokens: int) -> dict[str, Any]:
        by_tier = self.hits_by_tier()
        prompt = sum(r.prompt_tokens for r in self.requests)
        prefill = sum(r.prefill_tokens for r in self.requests)
        return {
            "policy": self.policy,
            "requests": len(self.requests),
            "blocks": self.blocks,
            "hit_blocks": self.hit_blocks,
            "hit_ratio": self.hit_blocks / self.blocks if self.blocks else 0.0,
            "memory_hit_ratio": (by_tier["L1"] + by_tier["L2"]) / self.blocks if self.blocks else 0.0,
            "hits_by_tier": by_tier,
            "prompt_tokens": prompt,
            "prefill_tokens": prefill,
            "prefill_tokens_saved": prompt - prefill,
            "ttft_p50_ms": self.ttft(50),
            "ttft_p90_ms": self.ttft(90),
            "ttft_p99_ms": self.ttft(99),
            "late_requests": sum(1 for r in self.requests if r.lag_s > 0.05),
            "mean_lag_s": sum(r.lag_s for r in self.requests) / max(len(self.requests), 1),
            "wall_s": self.wall_s,
            "peak_bytes": self.peak_bytes,
            "final_bytes": self.final_bytes,
            "bytes_by_codec": self.bytes_by_codec,
            "writes": self.writes,
            "sessions": self.sessions,
        }


def _added(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts added up over the repeats; anything else (a first error, a budget) the first set one."""
    out: dict[str, Any] = {}
    for d in dicts:
        for key, value in d.items():
            if isinstance(value, int) and not isinstance(value, bool) and key != "l3_budget_bytes":
                out[key] = out.get(key, 0) + value
            elif out.get(key) is None:
                out[key] = value
    return out
