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
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from kvstrata.codecs.arena import PageArena
from kvstrata.codecs.base import BlockContext, Codec
from kvstrata.codecs.pages import page_spec, to_pages
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.layer import KVStrataLayer
from kvstrata.integrations.transformers.paged import DenseScratch, PagedLayer, slot_positions

if TYPE_CHECKING:
    from kvstrata.store import KVStore, LoadedKV
    from kvstrata.store.sessions import Session

SINK_TOKENS = 4
"""The sequence's first tokens, which attention leans on whatever follows (attention sinks): a
block holding them is encoded without them (as the KIVI codec keeps them verbatim)."""

__all__ = ["KVStrataCache", "KVStrataLayer", "PagedLayer", "cache_for", "commit", "layer_devices"]


class KVStrataCache(Cache):
    """A transformers cache for one sequence whose first tokens came from the kvstrata store.

    ``prefix_tokens`` is how many tokens it was built with; ``loaded`` the :class:`LoadedKV`
    they came from (None when built empty); ``pages``: the blocks it holds encoded (its layers
    are then :class:`PagedLayer`), None when every token is exact.
    """

    def __init__(self, devices: Sequence[torch.device | str | None], pages: PageArena | None = None) -> None:
        if pages is None:
            layers: list[KVStrataLayer] = [KVStrataLayer(device) for device in devices]
        else:
            if pages.layout.num_layers != len(devices):
                raise ConfigError(f"pages of {pages.layout.num_layers} layers for a cache of {len(devices)}")
            scratch = DenseScratch()
            layers = [PagedLayer(pages, i, scratch, device) for i, device in enumerate(devices)]
        super().__init__(layers=layers)
        self.prefix_tokens = 0
        self.loaded: LoadedKV | None = None
        self.pages = pages

    @classmethod
    def from_kv(
        cls,
        kv: torch.Tensor | None,
        num_layers: int | None = None,
        *,
        devices: Sequence[torch.device | str | None] | None = None,
        model: torch.nn.Module | None = None,
        extra_tokens: int = 0,
        pages: PageArena | None = None,
    ) -> KVStrataCache:
        """A cache whose layer ``l`` starts with keys ``kv[0, l]`` and values ``kv[1, l]``.

        ``kv`` has shape ``(2, L, H, n, D)`` or is None (an empty cache of ``num_layers``
        layers). Each layer is placed on ``devices[l]``, else on the device of the model's
        decoder layer ``l`` (``model``), else where ``kv`` lies. ``extra_tokens`` reserves room
        for tokens to come (the prompt remainder and the answer) so that decoding never regrows.
        ``pages``: blocks of the sequence held encoded; ``kv`` then holds the exact tokens, those
        of the positions no block of ``pages`` covers, in order.
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
        cache = cls(devices, pages)
        if pages is not None and kv is None:
            kv = torch.empty(
                (2, n_layers, pages.layout.num_kv_heads, 0, pages.layout.head_dim),
                dtype=pages.layout.torch_dtype,
            )
        if kv is not None:
            for layer_idx, layer in enumerate(cache.layers):
                assert isinstance(layer, KVStrataLayer)
                layer.load_prefix(
                    kv[0, layer_idx].unsqueeze(0), kv[1, layer_idx].unsqueeze(0), extra_tokens=extra_tokens
                )
            cache.prefix_tokens = kv.shape[3] + (pages.tokens if pages is not None else 0)
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
        after ``num_tokens`` in that buffer are then overwritten as the cache grows. Blocks the
        store kept encoded (``loaded.pages``) stay so: the cache attends to them where they lie."""
        n = loaded.num_tokens if num_tokens is None else num_tokens
        pages = loaded.pages if loaded.pages is not None and len(loaded.pages) else None
        if pages is not None:
            n = min(n, loaded.num_tokens)
            if not pages.truncate(n):  # a block across the cut: decoded, as the tokens before it
                kv = loaded.kv
                cache = cls.from_kv(kv, len(devices), devices=devices, extra_tokens=extra_tokens, pages=pages)
                return cls.from_kv(
                    cache.new_kv(0, n), len(devices), devices=devices, extra_tokens=extra_tokens
                )
        exact = n - (pages.tokens if pages is not None else 0)
        buffer = loaded.buffer
        if (
            loaded.kv is None
            or buffer is None
            or n > loaded.num_tokens
            or buffer.shape[3] < exact + extra_tokens
            or buffer.shape[1] != len(devices)
            or any(d is not None and torch.device(d) != buffer.device for d in devices)
        ):
            kv = loaded.kv[:, :, :, :exact] if loaded.kv is not None and (exact or pages) else None
            return cls.from_kv(kv, len(devices), devices=devices, extra_tokens=extra_tokens, pages=pages)
        cache = cls(devices, pages)
        for layer_idx, layer in enumerate(cache.layers):
            assert isinstance(layer, KVStrataLayer)
            layer.adopt(buffer[0, layer_idx].unsqueeze(0), buffer[1, layer_idx].unsqueeze(0), exact)
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
        if self.pages is not None:
            return self._paged_kv(layers, start, end, target)
        keys = [layer.keys[0, :, start:end].to(target) for layer in layers]  # type: ignore[index]
        values = [layer.values[0, :, start:end].to(target) for layer in layers]  # type: ignore[index]
        return torch.stack([torch.stack(keys), torch.stack(values)])

    def encode_block(self, start: int, tokens: int, codec: Codec, sink_tokens: int = SINK_TOKENS) -> bool:
        """Hold the sequence's tokens ``start .. start + tokens`` (exact now) encoded with
        ``codec`` from here on: what a block leaving a request's recent window becomes. The
        sequence's first ``sink_tokens`` (attention sinks) stay exact. False (nothing changed)
        when ``codec``'s record of it cannot be held as pages."""
        if self.pages is None:
            raise ConfigError("encode_block needs a cache built with pages (a PageArena)")
        if start < sink_tokens:
            kept = sink_tokens - start
            if kept >= tokens:
                return False
            start, tokens = start + kept, tokens - kept
        before = sum(t for s, t in self.pages.covered() if s < start)
        first = start - before
        layers = [layer for layer in self.layers if isinstance(layer, PagedLayer)]
        with torch.inference_mode():
            block = torch.stack(
                [
                    torch.stack([layer.keys[0, :, first : first + tokens] for layer in layers]),  # type: ignore[index]
                    torch.stack([layer.values[0, :, first : first + tokens] for layer in layers]),  # type: ignore[index]
                ]
            ).cpu()
            record = codec.encode(block, BlockContext(start))
            spec = page_spec(record, self.pages.layout)
            if spec is None:
                return False
            self.pages.add(start, spec, to_pages(record, spec, self.pages.layout))
            for layer in layers:
                layer.remove(first, tokens)
        return True

    def slot_positions(self) -> torch.Tensor:
        """The sequence position of each of the cache's slots, in attention's order (the encoded
        blocks' tokens first): what a per-slot attention mass is folded back by."""
        exact = self.layers[0].length if isinstance(self.layers[0], KVStrataLayer) else 0
        return slot_positions(self.pages, exact)

    def _paged_kv(
        self, layers: list[KVStrataLayer], start: int, end: int, target: torch.device
    ) -> torch.Tensor:
        """``new_kv`` of a cache holding encoded blocks: positions after every block (what a
        commit asks) are exact tokens, sliced; other positions are dequantized, layer by layer."""
        assert self.pages is not None
        covered_end = max((s + t for s, t in self.pages.covered()), default=0)
        if start >= covered_end:
            offset = self.pages.tokens
            keys = [layer.keys[0, :, start - offset : end - offset].to(target) for layer in layers]  # type: ignore[index]
            values = [layer.values[0, :, start - offset : end - offset].to(target) for layer in layers]  # type: ignore[index]
            return torch.stack([torch.stack(keys), torch.stack(values)])
        slots = torch.argsort(self.slot_positions())[start:end]
        dtype = layers[0].keys.dtype  # type: ignore[union-attr]
        out = []
        with torch.inference_mode():  # the scratch is an inference tensor, as the layers' buffers
            for layer in layers:
                assert isinstance(layer, PagedLayer)
                keys, values = layer.dense(torch.float32)
                out.append(
                    torch.stack([keys[0, :, slots], values[0, :, slots]]).to(dtype=dtype, device=target)
                )
            return torch.stack(out, dim=1)


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
    loaded = store.load(session, want, capacity=want + extra_tokens, paged=True)
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
