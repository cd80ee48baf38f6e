"""Upgrade on urgency: a session whose class rises gets exact blocks before its next request.

A background agent's blocks are held lossy (KIVI-4 in device memory and below); when the agent
turns realtime, its next request must attend to exact KV. Where L3 keeps an exact copy of a
block (a ladder whose L3 rung for the old class is ``identity``: its sessions are upgradable),
that copy is read now and placed in device memory in place of the lossy ones, so the request finds
every block exact where it looks first and recomputes nothing. A block with no exact copy anywhere
is left as it is: the request path treats it as missing for the new class and recomputes from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstrata.codecs import loss_rank
from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.base import Tier


def make_exact(
    keys: Sequence[BlockKey],
    max_loss: int,
    held_in_memory: Callable[[BlockKey], list[int]],
    disk: Tier,
    put: Callable[[KVBlock], object],
) -> tuple[int, int]:
    """For each of ``keys`` held in memory lossier than ``max_loss`` allows, its exact L3 copy
    placed at the top. Returns (blocks made exact, blocks with no precise enough copy)."""
    made = left = 0
    for key in keys:
        held = held_in_memory(key)
        on_disk = disk.codec_of(key)
        if held and all(loss_rank(c) <= max_loss for c in held):
            continue
        if on_disk is None or loss_rank(on_disk) > max_loss:
            left += 1 if held or on_disk is not None else 0
            continue
        block = disk.get(key)
        if block is None:
            left += 1
            continue
        put(block)
        made += 1
    return made, left
