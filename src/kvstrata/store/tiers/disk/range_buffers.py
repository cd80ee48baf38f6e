"""The ranges of an L3 restore (:mod:`.stream`): how large, how many buffers, and the buffers.

A restore that decodes what it reads (int8, KIVI), or reads past the page cache, reads each range
into a buffer; the process keeps the largest of them, up to ``KEPT_BYTES``, for the next restore,
whichever store it serves.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from kvstrata.store.tiers.disk.segment_reads import CHUNK_BYTES, MIN_CHUNK_BYTES, Extent

NATIVE_SLOT_BYTES = 64 << 20
"""Bytes of buffers per restore for the ranges the native loop reads to be decoded: a buffer for
every range when they fit, so that the loop never waits for a decoder (each wait leaves the disk
idle: an int8 restore of 512 SmolLM2 tokens, 8 ranges, took 8.7-9.1 ms with 4 buffers and
7.8-7.9 with 8; with 16 or 40 the same, alternated in one process), else as many as fit. Direct
reads have no readahead to go on while the loop waits: an int8 restore of 4,096 tokens (52 MB)
read direct took 1.06x the time of the page-cache reads with 32 MiB of buffers, 0.80x with 64 and
0.75x with 128; an exact one (189 MB) 0.94x, 1.01x and 1.29x (memory past ``KEPT_BYTES`` is
fresh, and faults page by page)."""
NATIVE_MIN_SLOTS = 4
"""Buffers for such ranges at least: one per decoder and two for the loop to read ahead into."""
DECODERS = 2
"""Threads decoding the ranges of records that are not read in place (a decode costs more than a
read: int8 and KIVI dequantize every value)."""


KEPT_BYTES = 2 * NATIVE_SLOT_BYTES
"""Bytes of range buffers the process keeps between restores (two restores' worth), whichever
store they serve: a fresh buffer is fresh memory, which this VM's kernel zeroes page by page on
first touch. Kept per store, the first int8 restore of a store just opened allocated 3 of 4 MiB
and took 14.5 against 8.6 ms for the next one (512 SmolLM2 tokens)."""
_kept: list[bytearray] = []
_kept_lock = threading.Lock()


def take(count: int, size: int) -> queue.Queue[bytearray]:
    """``count`` buffers of at least ``size`` bytes: kept ones first (already paged in)."""
    buffers: queue.Queue[bytearray] = queue.Queue()
    with _kept_lock:
        for _ in range(count):
            fits = next((i for i, b in enumerate(_kept) if len(b) >= size), None)
            buffers.put(_kept.pop(fits) if fits is not None else bytearray(size))
    return buffers


def give_back(buffers: queue.Queue[bytearray]) -> None:
    """Keep the buffers for the next restore, the largest ones up to ``KEPT_BYTES``."""
    with _kept_lock:
        while not buffers.empty():
            _kept.append(buffers.get_nowait())
        _kept.sort(key=len, reverse=True)
        kept = 0
        for i, buffer in enumerate(_kept):
            kept += len(buffer)
            if kept > KEPT_BYTES:
                del _kept[i:]
                break


def native_slots(ranges: Sequence[int]) -> int:
    """Buffers for the native loop to read ``ranges`` (their sizes in bytes) into: one each when
    they fit in ``NATIVE_SLOT_BYTES``, else as many as fit, at least ``NATIVE_MIN_SLOTS``."""
    if not ranges:
        return 0
    return min(len(ranges), max(NATIVE_MIN_SLOTS, NATIVE_SLOT_BYTES // max(ranges)))


def buffered_chunk_bytes(extents: Sequence[Extent]) -> int:
    """Bytes per range for records that are decoded: ``CHUNK_BYTES``, smaller for a small
    restore, so that it still has several ranges to share between the decoders (a range's
    records are decoded one after another by one thread). An int8 restore of 512 SmolLM2 tokens
    (8.4 MB) took 2 ranges of 4 MiB and 1 more, one decoder running alone at the end: now 8,
    10-12 ms against 12-14.5 ms (alternated in one process, medians of 10)."""
    total = sum(e.placement.nbytes for e in extents)
    return max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, total // (4 * DECODERS)))
