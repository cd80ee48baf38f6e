"""Mooncake's published request traces (FAST'25), and how they become token ids.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``
with one id per 512-token block of the prompt (the last block partial); equal ids are identical
blocks, and ids are chained prefix hashes, so a repeated id means the whole prefix up to it is
shared.

Scaling for a CPU: each trace block becomes ``block_tokens`` token ids (the partial last block is
rounded up to a whole block), drawn from a generator seeded by the block's hash id, so equal ids
give equal tokens and, the ids being chained, equal prompts share exactly the blocks the trace
says they share. A prompt is its blocks' tokens plus one final token outside every block (the
request's "question"): a model needs at least one token to prefill, and so every trace block of a
prompt can be served from a cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstrata.errors import ConfigError

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def default_trace_path() -> Path:
    """``../shared/traces/conversation_trace.jsonl`` next to the repository (or the working dir)."""
    repo = Path(__file__).resolve().parents[3]
    for base in (Path.cwd().parent, repo.parent):
        candidate = base / "shared" / "traces" / "conversation_trace.jsonl"
        if candidate.is_file():
            return candidate
    return repo.parent / "shared" / "traces" / "conversation_trace.jsonl"


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of a trace file (all when None), validated."""
    if not path.is_file():
        raise ConfigError(f"no trace file at {path} (expected Mooncake's conversation_trace.jsonl)")
    requests: list[TraceRequest] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                request = TraceRequest(
                    int(row["timestamp"]),
                    int(row["input_length"]),
                    int(row["output_length"]),
                    tuple(int(h) for h in row["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path}:{number}: not a Mooncake trace line ({exc})") from None
            if not request.hash_ids:
                raise ConfigError(f"{path}:{number}: a request without hash_ids")
            requests.append(request)
    if not requests:
        raise ConfigError(f"{path} holds no requests")
    return requests


def conversation_of(request: TraceRequest) -> int | None:
    """The conversation a request belongs to: the id of its second block (its conversation's first
    private block; ids are chained, so every later turn carries it). None for a one-block prompt."""
    return request.hash_ids[1] if len(request.hash_ids) > 1 else None


def select(
    requests: Sequence[TraceRequest], *, sample_every: int = 1, max_blocks: int | None = None
) -> list[TraceRequest]:
    """Every ``sample_every``-th conversation (by the id of its second block, which names the
    conversation's first private block; so all turns of a kept conversation are kept), each
    prompt cut to its first ``max_blocks`` blocks (a cut keeps the prefix structure)."""
    if sample_every < 1:
        raise ConfigError("sample_every must be >= 1")
    if max_blocks is not None and max_blocks < 1:
        raise ConfigError("max_blocks must be >= 1")
    out = []
    for r in requests:
        conversation = conversation_of(r)
        if conversation is not None and conversation % sample_every:
            continue
        ids = r.hash_ids[:max_blocks] if max_blocks is not None else r.hash_ids
        out.append(TraceRequest(r.timestamp_ms, r.input_length, r.output_length, ids))
    return out


def ideal_hits(requests: Iterable[TraceRequest]) -> tuple[int, int, int]:
    """(hit blocks, total blocks, distinct blocks) of an infinite cache that holds every block
    seen before, replaying ``requests`` in order."""
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        for h in r.hash_ids:
            total += 1
            if h in seen:
                hits += 1
        seen.update(r.hash_ids)
    return hits, total, len(seen)


@dataclass(frozen=True, slots=True)
class TokenMap:
    """Hash id -> ``block_tokens`` token ids in ``[low, high)``, a pure function of the id."""

    block_tokens: int
    low: int
    high: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ConfigError("block_tokens must be >= 1")
        if not 0 <= self.low < self.high:
            raise ConfigError(f"empty token range [{self.low}, {self.high})")

    def block(self, hash_id: int) -> list[int]:
        rng = np.random.default_rng([self.seed, hash_id])
        return [int(t) for t in rng.integers(self.low, self.high, self.block_tokens)]

    def prompt(self, request: TraceRequest) -> list[int]:
        """The request's blocks, then one final token outside every block."""
        ids: list[int] = []
        for h in request.hash_ids:
            ids += self.block(h)
        return [*ids, self.low]
