"""Lossy memory modes measured: which blocks to keep when a session may hold only part of its KV.

A context is prefilled once with the importance tracker attached (the attention mass every block
received, divided by how many queries could see it, so that early blocks are not favoured merely
for being early). Then the continuation is teacher-forced over a cache that holds only the kept
blocks (keys keep their original rotary positions; new tokens get their true positions), for:

- ``full``: every block (the reference),
- ``recent``: the most recent blocks only (a plain sliding window),
- ``sinks+recent``: the first block (attention sinks) plus the most recent ones (StreamingLLM),
- ``importance``: the first block, the most recent one, and the most important of the rest.

Each mode keeps the same number of blocks (``budget`` of them); reported per mode: perplexity,
its change against ``full``, mean KL (full || mode) and top-1 agreement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstrata.errors import ConfigError
from kvstrata.eval.codec_quality import (
    StepCallback,
    _mean_kl,
    _perplexity,
    _prefill,
    _teacher_force,
    _top1_agreement,
)
from kvstrata.integrations.transformers.importance import ImportanceTracker
from kvstrata.integrations.transformers.model import LoadedModel, layout_for_config
from kvstrata.policy.memory import MemoryMode, MemoryModeKind

MODES = ("full", "recent", "sinks+recent", "importance")


@dataclass(frozen=True, slots=True)
class EvictionQuality:
    mode: str
    kept_blocks: list[int]
    budget: float
    ppl: float
    ppl_delta_pct: float
    kl: float
    top1: float


def block_scores(
    tracker: ImportanceTracker, num_blocks: int, block_tokens: int, context_tokens: int
) -> torch.Tensor:
    """Mean attention a block's tokens received per query that could attend to them."""
    mass = tracker.normalized(num_blocks)
    positions = torch.arange(num_blocks * block_tokens, dtype=torch.float64)
    visible = (context_tokens - positions).clamp(min=1).reshape(num_blocks, block_tokens).sum(dim=1)
    return mass / visible


def choose_blocks(mode: str, scores: torch.Tensor, keep: int, block_tokens: int = 64) -> list[int]:
    """The ``keep`` blocks (of ``scores.numel()``) each mode attends to. ``sinks+recent`` and
    ``importance`` are the runtime memory modes (:class:`MemoryMode`, one sink block and one
    recent block protected), so the figures measure the code the engine runs."""
    n = scores.numel()
    if mode == "full":
        return list(range(n))
    if mode == "recent":
        return list(range(n - keep, n))
    kinds = {"sinks+recent": MemoryModeKind.WINDOW, "importance": MemoryModeKind.IMPORTANCE}
    if mode not in kinds:
        raise ConfigError(f"unknown eviction mode {mode!r}; known: {', '.join(MODES)}")
    # the runtime budget counts one block for the tail (here: the scored tokens that follow)
    runtime = MemoryMode(kinds[mode], (keep + 1) * block_tokens, sink_blocks=1, recent_blocks=1)
    kept = runtime.keep(n, block_tokens, scores.tolist())
    return list(range(n)) if kept is None else kept


def evaluate_eviction(
    loaded_model: LoadedModel,
    token_ids: list[int],
    *,
    budget: float = 0.5,
    context_tokens: int = 1024,
    eval_tokens: int = 128,
    block_tokens: int = 64,
    on_step: StepCallback | None = None,
) -> list[EvictionQuality]:
    if not 0 < budget <= 1:
        raise ConfigError("budget must be in (0, 1]")
    if context_tokens % block_tokens or context_tokens < 4 * block_tokens:
        raise ConfigError(f"context_tokens must be a multiple of {block_tokens} and at least 4 blocks")
    if len(token_ids) < context_tokens + eval_tokens + 1:
        raise ConfigError(
            f"the text has {len(token_ids)} tokens, {context_tokens + eval_tokens + 1} are needed"
        )
    model = loaded_model.model
    layout = layout_for_config(model.config, model.dtype, block_tokens=block_tokens)
    ids = torch.tensor(token_ids[: context_tokens + eval_tokens + 1])
    tracker = ImportanceTracker(block_tokens)
    with torch.inference_mode():
        with tracker.attached(model):
            kv = _prefill(model, ids[:context_tokens])
        num_blocks = context_tokens // block_tokens
        keep = max(3, round(num_blocks * budget))
        scores = block_scores(tracker, num_blocks, block_tokens, context_tokens)
        stats = {}
        kept = {}
        for mode in MODES:
            kept[mode] = choose_blocks(mode, scores, keep, block_tokens)
            positions = torch.cat(
                [torch.arange(b * block_tokens, (b + 1) * block_tokens) for b in kept[mode]]
            )
            row_kv = kv[:, :, :, positions].contiguous()
            stats[mode] = _teacher_force(
                model, [row_kv], [None], ids, context_tokens, eval_tokens, layout, on_step
            )[0]
    reference = stats["full"]
    ppl_ref = _perplexity(reference)
    return [
        EvictionQuality(
            mode,
            kept[mode],
            1.0 if mode == "full" else len(kept[mode]) / num_blocks,
            _perplexity(stats[mode]),
            100 * (_perplexity(stats[mode]) / ppl_ref - 1) if math.isfinite(ppl_ref) else math.nan,
            _mean_kl(reference, stats[mode]),
            _top1_agreement(reference, stats[mode]),
        )
        for mode in MODES
    ]
