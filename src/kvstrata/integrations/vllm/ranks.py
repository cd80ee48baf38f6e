"""Tensor-parallel shards: one block of a TP=N model is N shards, one per rank, each keyed apart.

With tensor parallelism each worker (rank) holds only its share of the KV heads, so what one rank
stores is not what another needs. A block's *base key* is kvstrata's chained key of its tokens
(the same on every rank, computed by the scheduler); rank ``r`` of ``N`` stores its shard under
:func:`rank_key`, a hash of (base key, N, r). So:

* TP=1 keeps the base key itself: its blocks are interchangeable with those of every other
  kvstrata integration (a transformers engine on the same weights finds them);
* the shards of TP=2 and those of TP=1 or TP=4 never share a key, even when the per-rank layouts
  happen to be equal (KV heads replicated across ranks);
* a block counts as held only when every rank's shard is (see ``SchedulerSide``).

This module does not import vLLM.
"""

from __future__ import annotations

import hashlib

from kvstrata.errors import ConfigError
from kvstrata.keys import KEY_BYTES, BlockKey

_PERSON = b"kvstrata-tprank"


def rank_key(key: bytes, rank: int, tp_size: int) -> BlockKey:
    """The key rank ``rank`` of a ``tp_size``-way tensor-parallel model stores block ``key``'s shard under."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ConfigError(f"invalid tensor-parallel rank {rank} of {tp_size}")
    if tp_size == 1:
        return BlockKey(bytes(key))
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON)
    h.update(key)
    h.update(tp_size.to_bytes(4, "little"))
    h.update(rank.to_bytes(4, "little"))
    return BlockKey(h.digest())


def rank_keys(key: bytes, tp_size: int) -> list[BlockKey]:
    """The keys of every rank's shard of block ``key``."""
    return [rank_key(key, rank, tp_size) for rank in range(tp_size)]
