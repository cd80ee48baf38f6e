"""A cache layer whose history is partly held encoded: the HF Cache API over resident pages.

:class:`PagedLayer` is a :class:`~kvstrata.integrations.transformers.cache.KVStrataLayer` (its
exact tokens in a growable buffer, appended to in place) that also attends to the blocks of the
cache's :class:`~kvstrata.codecs.arena.PageArena`, held encoded (int8s, KIVI). Where the batched
engine's decode kernel runs, it reads the pages in place and this layer is only bookkeeping.
Everywhere else (a prefill, the transformers path of ``cache_for`` and ``generate``, a machine
without the kernel) :meth:`PagedLayer.update` returns the layer's keys and values as tensors:
the pages dequantized, then the exact tokens, into a :class:`DenseScratch` the cache's layers
share. Layers run one after the other, so one layer's worth is ever dequantized at a time, never
the whole context; the next layer overwrites it.

The tensors' order is the arena's tokens, then the exact ones, the newest last, so the causal
mask of new tokens (bottom-right aligned) is the usual one, and attention is the same as over the
tokens in sequence order (keys carry their positions). :func:`slot_positions` maps the order back
to sequence positions for the code that needs it (attention mass per block).
"""

from __future__ import annotations

from typing import Any

import torch

from kvstrata.codecs.arena import PageArena
from kvstrata.integrations.transformers.layer import KVStrataLayer


class DenseScratch:
    """Room for one layer's keys and values, ``(heads, tokens, head_dim)`` each, grown as needed
    and shared by a cache's layers (and by rows: it is filled and read within one layer's
    attention)."""

    def __init__(self) -> None:
        self.keys = torch.empty(0)
        self.values = torch.empty(0)

    def room(
        self,
        heads: int,
        tokens: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            self.keys.dim() != 3
            or self.keys.shape[0] != heads
            or self.keys.shape[1] < tokens
            or self.keys.shape[2] != head_dim
            or self.keys.device != device
            or self.keys.dtype != dtype
        ):
            capacity = max(tokens, 2 * self.keys.shape[1] if self.keys.dim() == 3 else 0)
            self.keys = torch.empty(heads, capacity, head_dim, device=device, dtype=dtype)
            self.values = torch.empty(heads, capacity, head_dim, device=device, dtype=dtype)
        return self.keys[:, :tokens], self.values[:, :tokens]


class PagedLayer(KVStrataLayer):
    """One layer's exact tokens plus the encoded blocks of ``pages`` (at ``layer_idx``)."""

    def __init__(
        self,
        pages: PageArena,
        layer_idx: int,
        scratch: DenseScratch,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(device)
        self.pages = pages
        self.layer_idx = layer_idx
        self.scratch = scratch

    def get_seq_length(self) -> int:
        return self.pages.tokens + (self.length if self.is_initialized else 0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.append(key_states, value_states)
        return self.dense()

    def remove(self, first: int, count: int) -> None:
        """Drop exact tokens ``first .. first + count`` (their block went into the pages): the
        exact tokens after them move down."""
        assert self._key_buffer is not None and self._value_buffer is not None
        end = self.length
        if not 0 <= first <= first + count <= end:
            raise ValueError(f"cannot remove exact tokens {first}:{first + count} of {end}")
        for buffer in (self._key_buffer, self._value_buffer):
            tail = buffer[..., first + count : end, :].clone()
            buffer[..., first : end - count, :].copy_(tail)
        self._set_length(end - count)

    def dense(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values, ``(1, heads, tokens, head_dim)``: the pages dequantized,
        then the exact tokens; in ``dtype`` (default: the exact tokens' dtype), dequantized into
        it directly (bfloat16: each float32 product rounded as ``.to()`` rounds it). Views of the
        cache's scratch, valid until the next layer's ``dense``."""
        assert self.keys is not None and self.values is not None
        exact_k, exact_v = self.keys[0], self.values[0]
        heads, exact, dim = exact_k.shape
        paged = self.pages.tokens
        want = dtype or exact_k.dtype
        keys, values = self.scratch.room(heads, paged + exact, dim, exact_k.device, want)
        self.pages.dequantize_layer(self.layer_idx, keys, values)
        keys[:, paged:].copy_(exact_k)
        values[:, paged:].copy_(exact_v)
        return keys.unsqueeze(0), values.unsqueeze(0)


def slot_positions(pages: PageArena | None, exact_tokens: int) -> torch.Tensor:
    """The sequence position of each slot of a cache's attention order."""
    if pages is None:
        return torch.arange(exact_tokens)
    return pages.logical_positions(exact_tokens)
