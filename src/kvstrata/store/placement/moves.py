"""The pure parts of the moves between memory tiers: which blocks go first, which a namespace at
its quota gives up, what a block costs in a tier, and blocks made fit to keep. No lock, no state:
:class:`~.memory.MemoryTiers` calls them with its lock held.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvstrata.codecs import loss_rank
from kvstrata.keys import BlockKey
from kvstrata.policy import EvictionScorer
from kvstrata.store.block import KVBlock
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.counters import StoreCounters
from kvstrata.store.tiers.base import Tier
from kvstrata.tiering import TierLevel

Hit = tuple[int, KVBlock, TierLevel]
"""A block served into a restore's buffer: (its index in the chain, the block, the tier)."""


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
    """``block`` with a tensor of its own (an L1 view is cloned before its slot is reused)."""
    if block.tensor is None:
        return block
    return KVBlock(block.key, block.num_tokens, block.start_pos, block.tensor.clone())


def charge(tier: Tier, block: KVBlock, slot_bytes: int) -> int:
    """Bytes ``block`` will take in ``tier``: a whole slot in L1, its encoded size below."""
    if tier.level is TierLevel.L1 or block.encoded is None:
        return slot_bytes
    return block.encoded.nbytes
