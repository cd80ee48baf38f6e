"""The worker side's background threads: saving copied pages into the store, and asynchronous loads.

:class:`BlockSaver` turns the page copies ``save_kv_layer`` took into kvstrata blocks and puts
them in the store, off the forward path; :class:`BlockLoader` runs asynchronous loads in the
order they were sent. Both run at a lower CPU priority than the forward pass where they may
(:func:`to_background`; the loader does not: a request waits on it). On a stop they finish
what is queued within a deadline and report what they could not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable

import torch

from kvstrata.integrations.vllm.events import EVENTS
from kvstrata.integrations.vllm.layout import PageFormat
from kvstrata.integrations.vllm.metadata import LoadSpec, SaveSpec
from kvstrata.integrations.vllm.ranks import rank_key
from kvstrata.priority import Priority
from kvstrata.runtime import lower_priority, single_threaded_torch
from kvstrata.store import KVStore
from kvstrata.store.block import KVBlock

log = logging.getLogger(__name__)


def to_background(thread: threading.Thread) -> bool:
    """Run ``thread`` at ``runtime.BACKGROUND_NICE`` (saving blocks, and the store's writers, yield the
    cores to the forward pass: on a CPU server they would otherwise slow the prefill that produced
    the blocks), on any core of the machine (Linux sets both per
    thread). vLLM's CPU workers pin their threads to the cores of their rank and keep others
    free for other work; a background thread then need not share the forward pass's core."""
    native_id = getattr(thread, "native_id", None)
    if native_id is None or not lower_priority(native_id):
        return False
    with contextlib.suppress(AttributeError, OSError):  # the kernel keeps the cores this process may use
        os.sched_setaffinity(native_id, range(os.cpu_count() or 1))
    return True


class BlockSaver:
    """Turns copied pages into blocks and puts them in the store, off the forward path."""

    def __init__(self, store: KVStore, rank: int, tp_size: int, failed: FailedKeys) -> None:
        self.store = store
        self.rank = rank
        self.tp_size = tp_size
        self.failed = failed
        self.max_queued_bytes = store.config.writer_queue_bytes
        """Page copies waiting beyond this are dropped, not queued: memory stays bounded when
        saving falls behind (a dropped block is a later miss)."""
        self._queue: queue.Queue[tuple[SaveSpec, list[torch.Tensor], PageFormat] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: set[bytes] = set()
        self._queued_bytes = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstrata-vllm-saver", daemon=True)
        self._thread.start()
        to_background(self._thread)

    def submit(self, spec: SaveSpec, pages: list[torch.Tensor], fmt: PageFormat) -> bool:
        """Queue a save; False (dropped, its keys reported as failed) when the queue is full."""
        size = sum(p.numel() * p.element_size() for p in pages)
        with self._lock:
            if self._queued_bytes and self._queued_bytes + size > self.max_queued_bytes:
                dropped = True
            else:
                dropped = False
                self._queued_bytes += size
                self._pending.update(spec.keys)
        if dropped:
            self.failed.add(spec.keys)
            EVENTS.emit("save_skipped", blocks=len(spec.keys), req_id=spec.req_id, rank=self.rank)
            return False
        self._queue.put((spec, pages, fmt))
        return True

    def flush(self, keys: Iterable[bytes] | None = None) -> None:
        """Wait until queued saves are in the store; with ``keys`` (base keys), only if one of them
        is queued."""
        if self._closed:
            return
        if keys is not None:
            with self._lock:
                if self._pending.isdisjoint(keys):
                    return
        self._queue.join()

    def close(self, deadline: float | None = None) -> int:
        """Save what is queued (until ``deadline``, ``time.monotonic()``), then stop; the blocks
        still queued or being saved at the deadline (not saved)."""
        if self._closed:
            return 0
        self._closed = True
        self._queue.put(None)
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            return 0
        with self._lock:
            return len(self._pending)

    def _run(self) -> None:
        single_threaded_torch()  # no OpenMP team beside the forward pass's (kvstrata.runtime)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                try:
                    self._save(*item)
                except Exception:
                    EVENTS.emit("save_error", blocks=len(item[0].keys), req_id=item[0].req_id)
                    self.failed.add(item[0].keys)
                    log.exception("kvstrata: saving blocks failed (they will be recomputed when needed)")
                finally:
                    with self._lock:
                        self._pending.difference_update(item[0].keys)
                        self._queued_bytes -= sum(p.numel() * p.element_size() for p in item[1])
            finally:
                self._queue.task_done()

    def _save(self, spec: SaveSpec, pages: list[torch.Tensor], fmt: PageFormat) -> None:
        layout = self.store.layout
        # per layer (n, H, N, C) pages -> (n, 2, L, H, N, D) blocks, one copy
        n = len(spec.keys)
        shape = (n, 2, layout.num_layers, layout.num_kv_heads, layout.block_tokens, layout.head_dim)
        blocks = torch.empty(shape, dtype=layout.torch_dtype, device=pages[0].device)
        for layer_idx, layer_pages in enumerate(pages):
            fmt.read_pages_into(layer_pages, blocks[:, :, layer_idx])
        priority = Priority.parse(spec.priority)
        for j, key in enumerate(spec.keys):
            shard = rank_key(key, self.rank, self.tp_size)
            start = spec.start_positions[j]
            block = KVBlock(shard, layout.block_tokens, start, blocks[j], namespace=spec.namespace)
            self.store.blocks.put(block, priority=priority, namespace=spec.namespace)
        EVENTS.emit("save", blocks=n, req_id=spec.req_id, rank=self.rank)


class FailedKeys:
    """Base keys whose save or load failed here, reported to the scheduler side once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: set[bytes] = set()

    def add(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._keys.update(keys)

    def take(self) -> set[bytes]:
        with self._lock:
            keys, self._keys = self._keys, set()
        return keys


class BlockLoader:
    """Runs asynchronous loads in a background thread, in the order they were sent."""

    def __init__(self, load: Callable[[LoadSpec], list[int]]) -> None:
        self._load = load
        self._queue: queue.Queue[LoadSpec | None] = queue.Queue()
        self._lock = threading.Lock()
        self._done: list[tuple[str, list[int]]] = []
        self._closed = False
        self.thread = threading.Thread(target=self._run, name="kvstrata-vllm-loader", daemon=True)
        self.thread.start()

    def submit(self, spec: LoadSpec) -> None:
        self._queue.put(spec)

    def take_done(self) -> list[tuple[str, list[int]]]:
        """The requests whose load finished since the last call, with the pages that failed."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self, deadline: float | None = None) -> None:
        """Finish the loads queued (until ``deadline``), then stop."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        single_threaded_torch()  # no OpenMP team beside the forward pass's (kvstrata.runtime)
        while True:
            spec = self._queue.get()
            if spec is None:
                return
            failed = self._load(spec)
            with self._lock:
                self._done.append((spec.req_id, failed))
