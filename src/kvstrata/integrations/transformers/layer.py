"""One decoder layer's exact keys and values in a growable buffer (the HF Cache API's layer).

:class:`KVStrataLayer` keeps ``(batch, heads, tokens, head_dim)`` keys and values in buffers
that grow by doubling, so a decode step appends in place instead of copying the whole history;
a restore's buffer is adopted as it is (no copy). :mod:`.paged` extends it with encoded blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

_MIN_CAPACITY_TOKENS = 64


class KVStrataLayer(DynamicLayer):
    """One layer's keys and values, ``(batch, heads, tokens, head_dim)``, in a growable buffer.

    ``self.keys`` / ``self.values`` are views of the first ``length`` tokens of the buffers, as
    the attention code and :class:`DynamicLayer`'s helpers expect.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.target_device = torch.device(device) if device is not None else None
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self.length = 0

    def load_prefix(self, keys: torch.Tensor, values: torch.Tensor, extra_tokens: int = 0) -> None:
        """Start from ``keys`` / ``values`` of shape ``(batch, heads, n, head_dim)`` (copied)."""
        device = self.target_device or keys.device
        n = keys.shape[-2]
        capacity = max(n + extra_tokens, _MIN_CAPACITY_TOKENS)
        shape = (*keys.shape[:-2], capacity, keys.shape[-1])
        self._key_buffer = torch.empty(shape, dtype=keys.dtype, device=device)
        self._value_buffer = torch.empty(shape, dtype=values.dtype, device=device)
        self._key_buffer[..., :n, :].copy_(keys)
        self._value_buffer[..., :n, :].copy_(values)
        self.device = device
        self.is_initialized = True
        self._set_length(n)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Use ``keys`` / ``values`` of shape ``(batch, heads, capacity, head_dim)`` as the
        buffers, holding ``length`` tokens already (no copy)."""
        self._key_buffer = keys
        self._value_buffer = values
        self.device = keys.device
        self.is_initialized = True
        self._set_length(length)

    def _set_length(self, n: int) -> None:
        assert self._key_buffer is not None and self._value_buffer is not None
        self.length = n
        self.keys = self._key_buffer.narrow(-2, 0, n)
        self.values = self._value_buffer.narrow(-2, 0, n)

    def _sync_from_views(self) -> None:
        """Adopt ``self.keys`` / ``self.values`` after a parent helper replaced them."""
        if self.keys is None or self.values is None:
            self._key_buffer = self._value_buffer = None
            self.length = 0
            return
        self._key_buffer = self.keys.contiguous()
        self._value_buffer = self.values.contiguous()
        self._set_length(self._key_buffer.shape[-2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        empty = key_states[..., :0, :]
        self.load_prefix(empty, value_states[..., :0, :], extra_tokens=key_states.shape[-2])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.append(key_states, value_states)

    def append(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens' keys and values in place; returns views of all exact tokens."""
        if not self.is_initialized or self._key_buffer is None:
            self.lazy_initialization(key_states, value_states)
        assert self._key_buffer is not None and self._value_buffer is not None
        n_new = key_states.shape[-2]
        needed = self.length + n_new
        if needed > self._key_buffer.shape[-2]:
            self._grow(max(needed, 2 * self._key_buffer.shape[-2]))
        start = self.length  # narrow, not [..., a:b, :]: a batched step calls this per row and layer
        self._key_buffer.narrow(-2, start, n_new).copy_(key_states)
        self._value_buffer.narrow(-2, start, n_new).copy_(value_states)
        self._set_length(needed)
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        assert self._key_buffer is not None and self._value_buffer is not None
        shape = (*self._key_buffer.shape[:-2], capacity, self._key_buffer.shape[-1])
        keys = self._key_buffer.new_empty(shape)
        values = self._value_buffer.new_empty(shape)
        keys[..., : self.length, :].copy_(self.keys)
        values[..., : self.length, :].copy_(self.values)
        self._key_buffer, self._value_buffer = keys, values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._set_length(max(0, self.length + tokens_to_remove))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._sync_from_views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._sync_from_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._sync_from_views()


def append_rows(
    native: ModuleType,
    layers: Sequence[Any],
    keys: torch.Tensor,
    values: torch.Tensor,
    sizes: list[int],
) -> bool:
    """Append the rows' new tokens to their :class:`KVStrataLayer` ``layers`` (one per row, the
    same layer of each) in one call of the native module (:mod:`kvstrata.engine.batch.decode_kernel`,
    ``append_rows``): ``keys`` / ``values`` ``(1, kv_heads, tokens, head_dim)``, ``sizes[i]`` of
    the tokens row ``i``'s. Each layer's ``keys`` / ``values`` views are lengthened in place, so
    that no new view is made per row and layer. False, with nothing written, where a layer is
    empty, its buffer full or of another dtype: the caller appends row by row (growing them)."""
    buffers: list[torch.Tensor] = []
    views: list[torch.Tensor] = []
    for layer in layers:
        if layer._key_buffer is None:
            return False
        buffers += (layer._key_buffer, layer._value_buffer)
        views += (layer.keys, layer.values)
    if not native.append_rows(keys, values, buffers, views, sizes):
        return False
    for layer, n in zip(layers, sizes, strict=True):
        layer.length += n
    return True
