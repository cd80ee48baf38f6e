"""Token importance: the attention probability mass each block of KV receives (H2O-style).

``ImportanceTracker`` registers a custom attention function with transformers that computes
eager attention and adds, for every key position, the probability mass all heads and queries
gave it, folded at once into per-block sums (one float per block, far under 5% of the KV bytes).
The policy's cost scorer and the importance-budgeted memory mode read these sums.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

_names = itertools.count()


class ImportanceTracker:
    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.block_mass = torch.zeros(0, dtype=torch.float64)
        self.name = f"kvstrata_importance_{next(_names)}"
        AttentionInterface.register(self.name, self._attention)
        # eager attention needs an explicit causal mask (the sdpa default may leave it implicit)
        AttentionMaskInterface.register(self.name, eager_mask)

    def _attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, weights = eager_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        per_key = weights.detach().float().sum(dim=(0, 1, 2))  # mass each key position received
        blocks = (per_key.numel() + self.block_tokens - 1) // self.block_tokens
        if blocks > self.block_mass.numel():
            grown = torch.zeros(blocks, dtype=torch.float64)
            grown[: self.block_mass.numel()] = self.block_mass
            self.block_mass = grown
        index = torch.arange(per_key.numel()) // self.block_tokens
        self.block_mass.index_add_(0, index, per_key.to(torch.float64))
        return out, weights

    @contextlib.contextmanager
    def attached(self, model: Any) -> Iterator[ImportanceTracker]:
        """Route ``model``'s attention through the tracker for the duration of the block."""
        previous = model.config._attn_implementation
        model.set_attn_implementation(self.name)
        try:
            yield self
        finally:
            model.set_attn_implementation(previous)

    def reset(self) -> None:
        self.block_mass = torch.zeros(0, dtype=torch.float64)

    def normalized(self, num_blocks: int) -> torch.Tensor:
        """Share of the total mass per block for the first ``num_blocks`` blocks."""
        mass = torch.zeros(num_blocks, dtype=torch.float64)
        n = min(num_blocks, self.block_mass.numel())
        mass[:n] = self.block_mass[:n]
        total = mass.sum()
        return mass / total if total > 0 else mass
