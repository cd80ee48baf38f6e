"""Copying a restore's blocks found in memory (L1, L2) into their slices of its buffer.

Into host memory without staging: an L1 block is one copy, an exact L2 block one copy of its bytes,
both as runs in one native call a thread (:class:`~kvstrata.store.run_copies.RunCopies`); other
blocks (and all of them while the native helpers are not built) through numpy views (a torch
slice costs microseconds, a numpy one a tenth of that). A large restore is shared between the
caller's thread and a pool (both copies release the GIL): one thread copies at about 7 GB/s here,
where memory takes about twice that.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
import torch

from kvstrata.codecs import CodecId
from kvstrata.errors import CorruptBlockError
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock, decode_into_room
from kvstrata.store.placement.moves import Hit
from kvstrata.store.run_copies import RunCopies
from kvstrata.transfer import DeviceCopier, host_array

COPY_THREADS = min(4, os.cpu_count() or 1)
"""Threads sharing the copies of a restore served from memory (L1, L2): memory bandwidth needs
more than one core, and more than about four rarely add to it."""
COPY_PART_BYTES = 4 << 20
"""The least a thread copies of such a restore (a hand-off to the pool costs about 0.1 ms)."""
STREAM_COPY_BYTES = 4 << 20
"""A restore from memory at least this large is copied with non-temporal stores, past the caches:
its destination would not stay in them (the model's weights stream through them in the forward
pass). 512 SmolLM2 tokens from L1 (23.6 MB): 0.87-1.16x of a memcpy streamed, 0.59-0.65x not
(AMD EPYC VM, 2026-12-02)."""


def copy_hits(
    hits: list[Hit],
    buffer: torch.Tensor,
    copier: DeviceCopier,
    layout: KVLayout,
    pool: Executor,
    threads: int,
) -> None:
    """Decode each hit ``(i, block, _)`` into block ``i``'s slice of ``buffer``, sharing a large
    restore with up to ``threads`` threads of ``pool``."""
    bt = layout.block_tokens
    if buffer.device.type != "cpu" or copier.staged:
        for i, block, _ in hits:
            decode_into_room(block, buffer[:, :, :, i * bt : (i + 1) * bt], copier, layout)
        return
    array = host_array(buffer)
    inference = torch.is_inference_mode_enabled()
    total = sum(block.num_tokens for _, block, _ in hits) * layout.bytes_per_token
    runs = RunCopies(buffer, bt, stream=total >= STREAM_COPY_BYTES)

    def copy(part: Sequence[Hit]) -> None:
        with torch.inference_mode(inference):
            for i, block, _ in runs.copy(part):  # the blocks it could not copy
                _copy_hit(block, i, array, buffer, copier, layout)

    parts = max(1, min(COPY_THREADS, threads, len(hits), total // COPY_PART_BYTES))
    if parts == 1:
        copy(hits)
        return
    cut = [len(hits) * k // parts for k in range(parts + 1)]
    futures = [pool.submit(copy, hits[cut[k] : cut[k + 1]]) for k in range(1, parts)]
    copy(hits[: cut[1]])
    for future in futures:
        future.result()


def _copy_hit(
    block: KVBlock, i: int, array: np.ndarray, buffer: torch.Tensor, copier: DeviceCopier, layout: KVLayout
) -> None:
    """Block ``i`` into its slice of the host ``buffer`` (``array`` is its numpy view)."""
    bt = layout.block_tokens
    dest = array[:, :, :, i * bt : i * bt + block.num_tokens]
    tensor, encoded = block.tensor, block.encoded
    if tensor is not None and tensor.device.type == "cpu" and tensor.dtype == buffer.dtype:
        np.copyto(dest, host_array(tensor))
    elif tensor is None and encoded is not None and encoded.codec == CodecId.IDENTITY:
        if len(encoded.payload) != dest.nbytes:
            raise CorruptBlockError(
                f"identity payload has {len(encoded.payload)} bytes, expected {dest.nbytes}"
            )
        np.copyto(dest, np.frombuffer(encoded.payload, dtype=dest.dtype).reshape(dest.shape))
    else:
        decode_into_room(block, buffer[:, :, :, i * bt : (i + 1) * bt], copier, layout)
