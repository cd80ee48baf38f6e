"""The transformers ``Cache`` that starts from KV kvstrata stored, and hands new KV back to it.

A :class:`KVStrataCache` holds one :class:`KVStrataLayer` per decoder layer. It is built from a
``(2, L, H, n, D)`` prefix tensor (what :meth:`KVStore.load` returns) by slicing, one copy per
layer onto that layer's device, so a model split over devices by ``device_map`` works. Each
layer keeps its keys and values in a buffer that grows by doubling, so a decode step appends in
place instead of copying the whole history. :meth:`KVStrataCache.new_kv` gathers the KV written
after a position back into the store's block shape for :meth:`KVStore.append`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    from kvstrata.store import KVStore, LoadedKV
    from kvstrata.store.sessions import Session

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


class KVStrataCache(Cache):
    """A transformers cache for one sequence whose first tokens came from the kvstrata store.

    ``prefix_tokens`` is how many tokens it was built with; ``loaded`` the :class:`LoadedKV`
    they came from (None when built empty).
    """

    def __init__(self, devices: Sequence[torch.device | str | None]) -> None:
        super().__init__(layers=[KVStrataLayer(device) for device in devices])
        self.prefix_tokens = 0
        self.loaded: LoadedKV | None = None

    @classmethod
    def from_kv(
        cls,
        kv: torch.Tensor | None,
        num_layers: int | None = None,
        *,
        devices: Sequence[torch.device | str | None] | None = None,
        model: torch.nn.Module | None = None,
        extra_tokens: int = 0,
    ) -> KVStrataCache:
        """A cache whose layer ``l`` starts with keys ``kv[0, l]`` and values ``kv[1, l]``.

        ``kv`` has shape ``(2, L, H, n, D)`` or is None (an empty cache of ``num_layers``
        layers). Each layer is placed on ``devices[l]``, else on the device of the model's
        decoder layer ``l`` (``model``), else where ``kv`` lies. ``extra_tokens`` reserves room
        for tokens to come (the prompt remainder and the answer) so that decoding never regrows.
        """
        if kv is not None and (kv.dim() != 5 or kv.shape[0] != 2):
            raise ConfigError(f"prefix KV must have shape (2, L, H, n, D), got {tuple(kv.shape)}")
        if devices is None and model is not None:
            devices = layer_devices(model)
        n_layers = kv.shape[1] if kv is not None else num_layers
        if n_layers is None and devices is not None:
            n_layers = len(devices)
        if n_layers is None:
            raise ConfigError("an empty KVStrataCache needs num_layers (or a model)")
        if devices is None:
            devices = [None] * n_layers
        if len(devices) != n_layers:
            raise ConfigError(f"{len(devices)} layer devices for {n_layers} layers")
        cache = cls(devices)
        if kv is not None:
            for layer_idx, layer in enumerate(cache.layers):
                assert isinstance(layer, KVStrataLayer)
                layer.load_prefix(
                    kv[0, layer_idx].unsqueeze(0), kv[1, layer_idx].unsqueeze(0), extra_tokens=extra_tokens
                )
            cache.prefix_tokens = kv.shape[3]
        return cache

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedKV,
        num_tokens: int | None = None,
        *,
        devices: Sequence[torch.device | str | None],
        extra_tokens: int = 0,
    ) -> KVStrataCache:
        """A cache of the first ``num_tokens`` (default: all) tokens of ``loaded``.

        When the store's buffer has room for ``extra_tokens`` more and lies on every layer's
        device, the layers adopt slices of it: the KV is not copied a second time. The tokens
        after ``num_tokens`` in that buffer are then overwritten as the cache grows."""
        n = loaded.num_tokens if num_tokens is None else num_tokens
        buffer = loaded.buffer
        if (
            loaded.kv is None
            or buffer is None
            or n > loaded.num_tokens
            or buffer.shape[3] < n + extra_tokens
            or buffer.shape[1] != len(devices)
            or any(d is not None and torch.device(d) != buffer.device for d in devices)
        ):
            kv = loaded.kv[:, :, :, :n] if loaded.kv is not None and n else None
            return cls.from_kv(kv, len(devices), devices=devices, extra_tokens=extra_tokens)
        cache = cls(devices)
        for layer_idx, layer in enumerate(cache.layers):
            assert isinstance(layer, KVStrataLayer)
            layer.adopt(buffer[0, layer_idx].unsqueeze(0), buffer[1, layer_idx].unsqueeze(0), n)
        cache.prefix_tokens = n
        return cache

    @classmethod
    def empty_for(cls, model: torch.nn.Module) -> KVStrataCache:
        return cls.from_kv(None, model=model)

    def new_kv(
        self, start: int, stop: int | None = None, *, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """KV of positions ``start:stop`` (default: to the end) as ``(2, L, H, n, D)`` for
        :meth:`KVStore.append`; on ``device`` (default: the first layer's device)."""
        layers = [layer for layer in self.layers if isinstance(layer, KVStrataLayer)]
        if len(layers) != len(self.layers) or not layers:
            raise ConfigError("new_kv needs a cache of KVStrataLayer layers")
        end = self.get_seq_length() if stop is None else stop
        if not 0 <= start <= end <= self.get_seq_length():
            raise ConfigError(
                f"cannot take KV of positions {start}:{end} from a cache of {self.get_seq_length()}"
            )
        if any(layer.keys is None or layer.keys.shape[0] != 1 for layer in layers):
            raise ConfigError("new_kv needs an initialized cache with batch size 1")
        target = torch.device(device) if device is not None else layers[0].keys.device  # type: ignore[union-attr]
        keys = [layer.keys[0, :, start:end].to(target) for layer in layers]  # type: ignore[index]
        values = [layer.values[0, :, start:end].to(target) for layer in layers]  # type: ignore[index]
        return torch.stack([torch.stack(keys), torch.stack(values)])


def layer_devices(model: torch.nn.Module) -> list[torch.device]:
    """The device of each decoder layer of a (possibly ``device_map``-split) causal LM."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigError(f"cannot find the decoder layers of {type(model).__name__}")
    return [next(layer.parameters()).device for layer in layers]


def cache_for(
    store: KVStore,
    session: Session,
    num_tokens: int | None = None,
    *,
    model: torch.nn.Module | None = None,
    devices: Sequence[torch.device | str | None] | None = None,
    extra_tokens: int = 0,
) -> KVStrataCache:
    """A cache holding the session's first ``num_tokens`` tokens (default: all) from the store.

    When a block is lost or corrupt the cache holds the tokens before it:
    ``cache.get_seq_length()`` (and ``cache.loaded.missing_from_token``) say how many, and the
    caller prefills from there.
    """
    want = session.num_tokens if num_tokens is None else min(num_tokens, session.num_tokens)
    loaded = store.load(session, want, capacity=want + extra_tokens)
    if devices is None:
        devices = layer_devices(model) if model is not None else [None] * store.layout.num_layers
    cache = KVStrataCache.from_loaded(loaded, devices=devices, extra_tokens=extra_tokens)
    cache.loaded = loaded
    return cache


def commit(
    store: KVStore,
    session: Session,
    cache: KVStrataCache,
    token_ids: Sequence[int],
    *,
    checkpoint: bool = True,
) -> None:
    """Append the KV of ``token_ids`` (the tokens after the session's last one, whose KV the cache
    holds at positions ``session.num_tokens`` onwards) to the session, then checkpoint it."""
    start = session.num_tokens
    stop = start + len(token_ids)
    if stop > cache.get_seq_length():
        raise ConfigError(
            f"the cache holds {cache.get_seq_length()} tokens; cannot commit {len(token_ids)} "
            f"tokens after the session's {start}"
        )
    if token_ids:
        store.append(session, token_ids, cache.new_kv(start, stop))
    if checkpoint:
        store.checkpoint(session)
