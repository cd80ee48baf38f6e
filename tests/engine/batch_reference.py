"""The single-request path the batched one is compared with: the engine's ``_forward`` (prefill
the remainder in one pass, then one token per pass, ``logits_to_keep=1``) on a KVStrataCache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.integrations.transformers.cache import KVStrataCache


@torch.inference_mode()
def solo_forward(
    model: torch.nn.Module, cache: KVStrataCache, token_ids: Sequence[int], position_offset: int = 0
) -> torch.Tensor:
    kwargs = {}
    if position_offset:
        first = cache.get_seq_length() + position_offset
        kwargs["position_ids"] = torch.arange(first, first + len(token_ids)).unsqueeze(0)
    out = model(
        input_ids=torch.tensor([list(token_ids)]), cache=cache, use_cache=True, logits_to_keep=1, **kwargs
    )
    return out.logits[0, -1].float()


def solo_greedy(
    model: torch.nn.Module,
    cache: KVStrataCache,
    prompt: Sequence[int],
    steps: int,
    position_offset: int = 0,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was picked from (``steps`` of each)."""
    logits = [solo_forward(model, cache, prompt, position_offset)]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < steps:
        logits.append(solo_forward(model, cache, [tokens[-1]], position_offset))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def prefix_kv(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """The real KV of ``token_ids`` (prefilled alone), as ``(2, L, H, n, D)``: what a restore returns."""
    cache = KVStrataCache.empty_for(model)
    solo_forward(model, cache, token_ids)
    return cache.new_kv(0).clone()


def restored(model: torch.nn.Module, history: list[int]) -> KVStrataCache:
    """A cache holding ``history``'s KV, built as a restore from the store builds it."""
    if not history:
        return KVStrataCache.empty_for(model)
    return KVStrataCache.from_kv(prefix_kv(model, history), model=model)


def ids(seed: int, n: int) -> list[int]:
    """``n`` random token ids of the tiny model's vocabulary, the same for the same seed."""
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
