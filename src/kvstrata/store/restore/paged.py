"""A restore that keeps encoded blocks encoded: device memory's pages copied as they are.

A request of an interactive or background agent attends to its older blocks where they lie, as
pages (:mod:`kvstrata.codecs.pages`), so its restore copies the pages device memory holds them in
into the request's :class:`~kvstrata.codecs.arena.PageArena` (one copy each, nothing decoded) and
restores the other blocks (exact ones, and those found only below device memory) the usual way
into the exact buffer, one after the other: the buffer then holds the sequence's tokens that no
page covers, in order, as the cache's exact part wants them.

A block no tier can serve ends the chain there, as in every restore: the pages after it are not
copied, and the caller recomputes from that token.

Pages are kept only where they hold at least half the tokens a prefill attends to (the prefix,
and the prompt's ``prefill`` tokens after it); else the restore is the usual one, every block
decoded into the exact buffer. A prefill attends over the pages dequantized into a scratch
buffer with the exact tokens copied behind them, layer by layer
(:class:`~kvstrata.integrations.transformers.paged.PagedLayer`), and with a few pages in front of
many exact tokens that copy costs more than the pages save: in ``kvstrata bench trace``'s
conversation trace (SmolLM2, a first block shared as a page in front of up to 177 exact tokens)
it took 80 us a layer, 2.4 ms a request, and kvstrata's TTFT was 0.7 ms above plain exact LRU's
per request (each request replayed under both, one after the other); decoding such pages at the
restore instead brought it to 0.25-0.55 ms below.
Where the pages are the majority (an agent's long history) they stay encoded: the memory they
save is most of the row's. The tokens to generate do not count: a decode row's attention reads
pages and exact tokens where they lie (the native kernel), copying neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstrata.codecs.arena import PageArena
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.priority import Priority
from kvstrata.store.placement.device_pages import DevicePages
from kvstrata.tiering import TierLevel


class RestoreInto(Protocol):
    """The usual restore (``TieredStore.restore``): the tokens it served and by which tier."""

    def __call__(
        self,
        keys: Sequence[BlockKey],
        buffer: torch.Tensor,
        want: int,
        *,
        full: int,
        priority: Priority | None,
        max_loss: int | None,
    ) -> tuple[int, dict[TierLevel, int]]: ...


@dataclass(frozen=True, slots=True)
class PagedRestore:
    buffer: torch.Tensor
    """The exact tokens (those no page covers, in order) in their first slots, room after."""
    exact_tokens: int
    pages: PageArena
    num_tokens: int
    by_tier: dict[TierLevel, int]


def restore_paged(
    device: DevicePages,
    restore: RestoreInto,
    keys: Sequence[BlockKey],
    want: int,
    *,
    full: int,
    room: int,
    prefill: int,
    layout: KVLayout,
    priority: Priority | None,
    max_loss: int | None,
    on: torch.device,
    out: torch.Tensor | None = None,
) -> PagedRestore | None:
    """The first ``want`` tokens of ``keys``' blocks (the first ``full`` full ones), device
    memory's pages kept as they are; ``room``: tokens to leave room for after them; ``prefill``:
    the prompt's tokens the caller computes after them; ``out``: a buffer to reuse for the exact
    tokens when it has the room. None when device memory holds none of these blocks as pages, or
    pages for less than half of ``want + prefill`` tokens (the caller restores as usual)."""
    bt = layout.block_tokens
    count = min(len(keys), -(-want // bt))
    expected = [bt if i < count - 1 else want - (count - 1) * bt for i in range(count)]
    found = device.pages(keys[:count], max_loss)
    paged = [h is not None and h[0].tokens == expected[i] for i, h in enumerate(found)]
    if 2 * sum(n for n, p in zip(expected, paged, strict=True) if p) < want + prefill:
        return None  # a minority of the row's tokens: decoded with the rest (the module's docstring)
    others = [i for i in range(count) if not paged[i]]
    exact_want = sum(expected[i] for i in others)
    exact_full = sum(1 for i in others if i < full)
    blocks = -(-exact_want // bt) if exact_want else 0
    shape = layout.block_shape(max(blocks * bt + room, 1))
    if out is not None and out.shape[3] >= shape[3]:
        buffer = out
    else:
        buffer = torch.empty(shape, dtype=layout.torch_dtype, device=on)
    got, by_tier = (0, {})
    if others:
        chain = [keys[i] for i in others]
        got, by_tier = restore(
            chain, buffer, exact_want, full=exact_full, priority=priority, max_loss=max_loss
        )
    # the chain ends at the first block that was not served: exact ones are served in order
    arena_bytes = sum(
        h[0].block_nbytes(layout) for h, p in zip(found, paged, strict=True) if h is not None and p
    )
    arena = PageArena(layout, arena_bytes, on)
    served_exact = got
    total = 0
    hits: list[tuple[BlockKey, int, int]] = []
    for i in range(count):
        if paged[i]:
            spec, view, start = found[i]  # type: ignore[misc]
            arena.add(i * bt, spec, view)
            hits.append((keys[i], spec.tokens, start))
        elif served_exact >= expected[i]:
            served_exact -= expected[i]
        else:
            total += served_exact
            break
        total += expected[i]
    device.record_hits(hits, priority)
    paged_tokens = sum(tokens for _, tokens, _ in hits)
    if paged_tokens:
        by_tier[TierLevel.L1] = by_tier.get(TierLevel.L1, 0) + paged_tokens
    return PagedRestore(buffer, total - paged_tokens, arena, total, by_tier)
