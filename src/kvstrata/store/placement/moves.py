"""The pure parts of the moves between memory tiers: which blocks go first, which a namespace at
its quota gives up, what a block costs in a tier, and blocks made fit to keep. No lock, no state:
:class:`~.memory.MemoryTiers` calls them with its lock held.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvstrata.codecs import Codec, CodecId, loss_rank
from kvstrata.codecs.pages import PageSpec
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy import EvictionScorer
from kvstrata.store.block import KVBlock
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.counters import StoreCounters
from kvstrata.store.tiers.base import PagedTier, SlotCharges, Tier
from kvstrata.tiering import TierLevel

Hit = tuple[int, KVBlock, TierLevel]
"""A block served into a restore's buffer: (its index in the chain, the block, the tier)."""
PagedHit = tuple[PageSpec, torch.Tensor, int]
"""A block device memory holds as pages: how they lie, a view of them, its first position."""


class Compressible(Protocol):
    """What compression asks the ladder: the codec an L1 block held in a codec should have."""

    def compressible(self, key: BlockKey, held_codec: int) -> Codec | None: ...

    @property
    def layout(self) -> KVLayout: ...


def pages_of(tier: PagedTier, keys: Sequence[BlockKey], max_loss: int | None) -> list[PagedHit | None]:
    """Per key, the pages ``tier`` holds it as, when precise enough for ``max_loss``."""
    found: list[PagedHit | None] = []
    for key in keys:
        held = tier.pages(key)
        if held is not None and max_loss is not None and loss_rank(held[0].codec) > max_loss:
            held = None  # looked for below, where a precise enough copy may lie
        found.append(held)
    return found


class PagedDeviceTier(PagedTier, Tier, Protocol):
    """Device memory as compression uses it: a tier that hands out its pages."""


def held_as(tier: PagedDeviceTier, key: BlockKey) -> int | None:
    """The form device memory holds ``key`` in: its pages' codec, or identity for a decoded block
    (whatever precision its values carry, which ``codec_of`` reports); None when it is absent."""
    codec = tier.codec_of(key)
    if codec is None or tier.pages(key) is not None:
        return codec
    return int(CodecId.IDENTITY)


def compress_in_place(
    tier: PagedDeviceTier, candidates: Sequence[BlockKey], ladder: Compressible, target: float
) -> int:
    """Re-encode ``tier``'s blocks held more precisely than their class asks (device memory's
    exact copies of lossy classes' blocks), in ``candidates``' order, until the tier holds at
    most ``target`` bytes; how many were."""
    done = 0
    for key in candidates:
        if tier.usage().used_bytes <= target:
            break
        codec = held_as(tier, key)
        goal = ladder.compressible(key, codec) if codec is not None else None
        block = tier.get(key) if goal is not None else None
        if goal is None or block is None:
            continue
        encoded = own(block).reencoded(goal, ladder.layout)
        tier.remove(key)
        tier.put(encoded)
        done += 1
    return done


def demotion_order(
    tier: Tier, stats: BlockStatsTable, scorer: EvictionScorer, keep: Callable[[BlockKey], bool]
) -> list[BlockKey]:
    """Keys of ``tier`` that may be demoted (not held, not ``keep``), in demotion order: the
    scorer's, with protected blocks (a session's recent window, the first block holding the
    attention sinks, a system prompt's blocks) only after every other candidate."""
    candidates = []
    keys = list(tier.keys())
    for key, s in zip(keys, stats.ensure_many(keys, when=0.0), strict=True):
        if s.ref_count > 0 or keep(key):
            continue
        s.nbytes = tier.block_bytes(key)
        candidates.append(s)
    plain = [s for s in candidates if not (s.recent or s.protected or s.start_pos == 0)]
    protected = [s for s in candidates if s.recent or s.protected or s.start_pos == 0]
    now = time.monotonic()
    return scorer.order(plain, now) + scorer.order(protected, now)


def quota_victims(
    tier: Tier, namespace: str, size: int, limit: int, stats: BlockStatsTable, scorer: EvictionScorer
) -> tuple[int, list[BlockKey]]:
    """The bytes ``namespace`` holds in ``tier``, and which of its own blocks (not held) to demote,
    first to go first, so that ``size`` more bytes fit in its quota of ``limit`` (as many as
    there are: fewer when the rest is held)."""
    own_keys = [
        key
        for key in tier.keys()  # noqa: SIM118 (a Tier method)
        if (s := stats.get(key)) is not None and (s.namespace or "") == namespace
    ]
    used = sum(tier.block_bytes(key) for key in own_keys)
    if used + size <= limit:
        return used, []
    candidates = []
    for key, s in zip(own_keys, stats.ensure_many(own_keys), strict=True):
        if s.ref_count == 0:
            s.nbytes = tier.block_bytes(key)
            candidates.append(s)
    victims = []
    left = used
    for key in scorer.order(candidates, time.monotonic()):
        if left + size <= limit:
            break
        left -= tier.block_bytes(key)
        victims.append(key)
    return used, victims


def acceptable(block: KVBlock, max_loss: int | None, counters: StoreCounters) -> bool:
    """Whether a copy is precise enough for a reader accepting ``max_loss`` (counted if not)."""
    if max_loss is None or block.encoded is None or block.tensor is not None:
        return True
    if loss_rank(block.encoded.codec) <= max_loss:
        return True
    counters.rejected_lossy += 1
    return False


def resident(block: KVBlock, room: torch.Tensor) -> KVBlock:
    """``block`` for promotion: its decoded tensor is its slice of the destination (memory
    tiers copy what they keep), its encoded form kept when it lives on (not a read buffer)."""
    tensor = room[:, :, :, : block.num_tokens]
    encoded = block.encoded if block.tensor is None and _owned(block) else None
    return KVBlock(block.key, block.num_tokens, block.start_pos, tensor, encoded, block.namespace)


def _owned(block: KVBlock) -> bool:
    """Whether the payload is its own bytes (not a view of a buffer that will be reused)."""
    return block.encoded is not None and isinstance(block.encoded.payload, bytes | bytearray)


def own(block: KVBlock) -> KVBlock:
    """``block`` with a tensor (or record) of its own: an L1 view is copied before its slot is
    reused."""
    if block.tensor is None:
        encoded = block.encoded
        if encoded is None or isinstance(encoded.payload, bytes):
            return block
        owned = dataclasses.replace(encoded, payload=bytes(encoded.payload))
        return KVBlock(block.key, block.num_tokens, block.start_pos, None, owned, block.namespace)
    return KVBlock(block.key, block.num_tokens, block.start_pos, block.tensor.clone())


def charge(tier: Tier, block: KVBlock, slot_bytes: int) -> int:
    """Bytes ``block`` will take in ``tier``: a whole slot in L1 (a decoded block's, or its
    codec's pages'), its encoded size below."""
    if isinstance(tier, SlotCharges):
        return tier.charge(block)
    if tier.level is TierLevel.L1 or block.encoded is None:
        return slot_bytes
    return block.encoded.nbytes


def idle_keys(tier: Tier, stats: BlockStatsTable, idle_s: float) -> list[BlockKey]:
    """Keys of ``tier`` not held and unused for ``idle_s`` seconds."""
    now = time.monotonic()
    return [
        key
        for key in tier.keys()  # noqa: SIM118 (a Tier method)
        if (s := stats.get(key)) is not None and s.ref_count == 0 and now - s.last_access > idle_s
    ]


def namespace_bytes(tiers: Sequence[Tier], stats: BlockStatsTable) -> dict[tuple[str, TierLevel], int]:
    """Bytes per (namespace, tier) ``tiers`` hold."""
    out: dict[tuple[str, TierLevel], int] = {}
    for tier in tiers:
        for key in tier.keys():  # noqa: SIM118 (a Tier method)
            block_stats = stats.get(key)
            slot = ((block_stats.namespace if block_stats is not None else None) or "", tier.level)
            out[slot] = out.get(slot, 0) + tier.block_bytes(key)
    return out
