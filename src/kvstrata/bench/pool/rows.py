"""The rows ``kvstrata bench pool`` times: one session's context held exact, or with every full
block out of the recent window encoded (the sinks and the window exact), as the pool holds an
interactive (int8s) or a background (kivi4) agent, or the graded rung most of its blocks (kvmix)."""

from __future__ import annotations

from typing import Any

import torch

EXACT = "exact"
ENCODED = ("int8s", "kivi4", "kvmix")


def context_kv(model: Any, tokens: int, seed: int = 0) -> torch.Tensor:
    """A real context's KV ``(2, L, H, tokens, D)``: ``tokens`` token ids drawn from the model's
    vocabulary, prefilled in chunks of 512 (sdpa; the model's dtype)."""
    from kvstrata.integrations.transformers.cache import KVStrataCache

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, model.config.vocab_size - 10, (tokens,), generator=generator)
    cache = KVStrataCache.empty_for(model)
    with torch.inference_mode():
        for start in range(0, tokens, 512):
            chunk = ids[start : start + 512].unsqueeze(0)
            positions = torch.arange(start, start + chunk.shape[1]).unsqueeze(0)
            model(input_ids=chunk, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        return cache.new_kv(0)


def build_row(model: Any, kv: torch.Tensor, held: str, extra_tokens: int, recent_blocks: int = 1) -> Any:
    """A batch row over ``kv`` held ``held`` (``exact`` or a page codec's name)."""
    from kvstrata.codecs import get_codec
    from kvstrata.codecs.arena import PageArena
    from kvstrata.engine.batch import BatchRow
    from kvstrata.integrations.transformers.cache import KVStrataCache
    from kvstrata.integrations.transformers.model import layout_for_config

    if held == EXACT:
        return BatchRow(KVStrataCache.from_kv(kv, model=model, extra_tokens=extra_tokens))
    layout = layout_for_config(model.config, model.dtype)
    cache = KVStrataCache.from_kv(kv, model=model, extra_tokens=extra_tokens, pages=PageArena(layout))
    bt = layout.block_tokens
    codec = get_codec(held)
    for block in range(kv.shape[3] // bt - recent_blocks):
        cache.encode_block(block * bt, bt, codec)
    return BatchRow(cache)


def held_bytes(row: Any) -> int:
    """Bytes of the row's context: its pages and its exact tokens (the rest of their buffers aside)."""
    pages = row.cache.pages
    exact = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in row.cache.layers)
    return exact + (pages.nbytes if pages is not None else 0)


def crop(row: Any, tokens: int) -> None:
    """Drop the row's last ``tokens`` tokens (a timed step's), so the next one sees the same context."""
    for layer in row.cache.layers:
        layer.crop(-tokens)
