"""Recycled buffers for the blocks a store copies out of a caller's KV.

``append`` cuts a session's KV into blocks and copies each one out of the caller's tensor (the
caller may reuse its memory at once, while the block waits for the writer). A fresh buffer for
that copy is fresh memory: on this VM the kernel zeroes each new page on first touch, and a
2.9 MB SmolLM2 block took 1.4-2.3 ms to copy into fresh memory against 0.3-0.4 ms into memory
already touched. glibc hands such large buffers back to the system when they are freed, so every
checkpoint paid that again: 17 of the 25-45 ms of a 512-token checkpoint (8 blocks).

:class:`StagingBuffers` keeps up to ``max_bytes`` of block buffers for the whole process and hands
one out again only when nothing refers to it any more: no Python reference besides the pool's
(``sys.getrefcount``) and no tensor sharing its memory (a view of it keeps its storage's use
count up). A buffer still held anywhere (queued for the writer, read by a restore, sliced by a
caller) is never reused; when none is free and the budget is spent, the copy goes to fresh memory
as before. Where torch does not expose a storage's use count the pool stays empty.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvstrata.store._native_crc import copy_runs
from kvstrata.transfer import copy_tensor

DEFAULT_MAX_BYTES = 128 << 20
"""Buffers the process keeps for block copies: a 2,048-token SmolLM2 checkpoint in flight (32
blocks of 2.9 MB), about half the writer's default queue."""
GROUP_BYTES = 4 << 20
"""A session's append copies blocks out of the caller's KV in groups of about this many bytes (at
least one block), each group in one go, and hands a group's blocks to the tiers before copying the
next: the writer starts on the first blocks while the later ones are copied."""


def _storage_use_count() -> Callable[[Any], int] | None:
    count = getattr(torch._C, "_storage_Use_Count", None)  # private: checked once, used if there
    if count is None:
        return None
    probe = torch.empty(4)
    try:
        alone = count(probe.untyped_storage()._cdata)
        view = probe[1:]
        shared = count(probe.untyped_storage()._cdata)
        del view
    except Exception:
        return None
    return count if (alone, shared) == (2, 3) else None


_USE_COUNT = _storage_use_count()


PROBES = 4
"""Buffers of the wanted shape looked at per copy, oldest handed out first (the writer releases
blocks in the order they came): a full scan made a 512-block checkpoint quadratic. When those are
held and the budget is spent, they go to the back: the next copy looks at the next ones, so
buffers held for long (blocks a device or host cache keeps) do not stop the pool for good."""


class StagingBuffers:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._rings: dict[tuple[tuple[int, ...], torch.dtype], deque[torch.Tensor]] = {}
        """Buffers per (shape, dtype), the one handed out longest ago on the left."""
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        """Copies that went into a recycled buffer (for the tests and the curious)."""

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``src``, in a recycled buffer when one of its shape is free."""
        return self.copy_many([src])[0]

    def copy_many(self, srcs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Contiguous copies of ``srcs``, each in a recycled buffer when one of its shape is free.
        The copies into recycled buffers are made by ONE native call where the helpers are built
        (the GIL let go once for all of them): every copy that lets go of the GIL must take it
        back, and while the writer thread runs Python it waits up to the interpreter's switch
        interval. A 512-block checkpoint of the tiny model spent 55-65 ms in its copies, 33-36 ms
        of it copying."""
        out: list[torch.Tensor] = []
        runs: list[tuple[torch.Tensor, torch.Tensor, np.ndarray, int]] = []
        for src in srcs:
            buffer = None
            if src.device.type == "cpu" and _USE_COUNT is not None:
                buffer = self._take(tuple(src.shape), src.dtype)
            if buffer is None:
                out.append(src.contiguous())
                continue
            rows = _rows(src)
            if rows is None:
                # through numpy, in this thread alone: torch's copy of a large tensor runs on the
                # thread's OpenMP team, whose workers took the second of two cores from the writer
                # thread mid-checkpoint (a 2.9 MB copy took 4-6.7 ms there against 0.4, 2026-12-01)
                copy_tensor(buffer, src)
            else:
                runs.append((buffer, src, *rows))
            out.append(buffer)
        if runs:
            _copy_rows(runs)
        return out

    def _take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        with self._lock:
            ring = self._rings.setdefault((shape, dtype), deque())
            for i in range(min(PROBES, len(ring))):
                if _unused(ring, i):
                    ring.append(ring[i])  # to the right end: handed out last
                    del ring[i]
                    self.reused += 1
                    return ring[-1]
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            if self._bytes + nbytes > self.max_bytes:
                self._drop_free(nbytes, keep=ring)
            if self._bytes + nbytes > self.max_bytes:
                ring.rotate(-min(PROBES, len(ring)))  # those looked at, held, to the back
                return None
            with torch.inference_mode(False):
                ring.append(torch.empty(shape, dtype=dtype))
            self._bytes += nbytes
            return ring[-1]

    def _drop_free(self, need: int, keep: deque[torch.Tensor]) -> None:
        """Drop free buffers of other shapes until ``need`` more bytes fit."""
        for key, ring in list(self._rings.items()):
            if ring is keep:
                continue
            for i in reversed(range(len(ring))):
                if self._bytes + need <= self.max_bytes:
                    return
                if _unused(ring, i):
                    self._bytes -= ring[i].numel() * ring[i].element_size()
                    del ring[i]
            if not ring:
                del self._rings[key]

    @property
    def held_bytes(self) -> int:
        return self._bytes


def _rows(src: torch.Tensor) -> tuple[np.ndarray, int] | None:
    """The rows of ``src`` (a block cut out of a KV: its last two dimensions contiguous) as
    (byte offsets from its first element, bytes a row); None for another layout."""
    if src.dim() < 2 or src.stride(-1) != 1 or src.stride(-2) != src.shape[-1] or src.numel() == 0:
        return None
    outer = src.shape[:-2]
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(outer, src.stride()[:-2], strict=True):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
    element = src.element_size()
    return offsets * element, src.shape[-2] * src.shape[-1] * element


def _copy_rows(runs: list[tuple[torch.Tensor, torch.Tensor, np.ndarray, int]]) -> None:
    """Copy each ``(buffer, src, row offsets, row bytes)`` row by row into its contiguous buffer:
    one native call for all of them, else numpy block by block."""
    dest = np.concatenate(
        [buffer.data_ptr() + np.arange(len(rows), dtype=np.int64) * run for buffer, _, rows, run in runs]
    )
    src = np.concatenate([s.data_ptr() + rows for _, s, rows, _ in runs])
    lens = np.concatenate([np.full(len(rows), run, dtype=np.int64) for _, _, rows, run in runs])
    if not copy_runs(dest, src, lens, stream=False):
        for buffer, s, _, _ in runs:
            copy_tensor(buffer, s)


def _unused(ring: deque[torch.Tensor], i: int) -> bool:
    """Whether nothing but the pool refers to ``ring[i]``: 2 references to the tensor (the ring,
    getrefcount's argument) and 2 uses of its memory (the tensor, and the wrapper that
    ``untyped_storage()`` returns); a view of it would be a third."""
    return (
        sys.getrefcount(ring[i]) == 2 and _USE_COUNT(ring[i].untyped_storage()._cdata) == 2  # type: ignore[misc]
    )


BUFFERS = StagingBuffers()
"""The process's pool (stores in one process share it: each checkpoint's copies reuse the last one's)."""
