"""The worker side: moving blocks between vLLM's paged KV cache and the store.

* Loads: the scheduler side already read and verified the blocks; ``start_load_kv`` writes them
  into the request's pages of every layer before the forward pass (a synchronous load: the same
  step computes the rest of the prompt on top of them).
* Saves: after each layer's attention, ``save_kv_layer`` copies the pages of the blocks to save out
  of that layer's cache (the only work on the forward path). ``wait_for_save`` hands the copies to a
  background thread, which turns them into kvstrata blocks and puts them in the store; the store's
  own background writer then writes them to L3 (and L4).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from typing import Any

import torch

from kvstrata.errors import ConfigError
from kvstrata.integrations.vllm.layout import PageFormat
from kvstrata.integrations.vllm.metadata import KVStrataConnectorMetadata, SaveSpec
from kvstrata.integrations.vllm.shared import EVENTS
from kvstrata.keys import BlockKey
from kvstrata.priority import Priority
from kvstrata.store import KVStore
from kvstrata.store.block import KVBlock

log = logging.getLogger(__name__)


def _layer_index(name: str, fallback: int) -> int:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return int(extract_layer_index(name))
    except Exception:
        return fallback


class BlockSaver:
    """Turns copied pages into blocks and puts them in the store, off the forward path."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self._queue: queue.Queue[tuple[SaveSpec, list[torch.Tensor], PageFormat] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: set[bytes] = set()
        self._thread = threading.Thread(target=self._run, name="kvstrata-vllm-saver", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, spec: SaveSpec, pages: list[torch.Tensor], fmt: PageFormat) -> None:
        with self._lock:
            self._pending.update(spec.keys)
        self._queue.put((spec, pages, fmt))

    def flush(self, keys: Iterable[bytes] | None = None) -> None:
        """Wait until queued saves are in the store; with ``keys``, only if one of them is queued."""
        if self._closed:
            return
        if keys is not None:
            with self._lock:
                if self._pending.isdisjoint(keys):
                    return
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._queue.put(None)
        self._thread.join()
        self._closed = True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                try:
                    self._save(*item)
                finally:
                    with self._lock:
                        self._pending.difference_update(item[0].keys)
            except Exception:
                EVENTS.save_errors += 1
                log.exception("kvstrata: saving blocks failed (they will be recomputed when needed)")
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
            tensor = blocks[j]  # contiguous
            block = KVBlock(
                BlockKey(key), layout.block_tokens, spec.start_positions[j], tensor, namespace=spec.namespace
            )
            self.store.put_block(block, priority=priority, namespace=spec.namespace)
            EVENTS.blocks_saved += 1


class WorkerSide:
    def __init__(self, store: KVStore, vllm_config: Any, saver: BlockSaver) -> None:
        self.store = store
        self.layout = store.layout
        self.vllm_config = vllm_config
        self.saver = saver
        self.layers: list[tuple[str, torch.Tensor]] = []
        self._layer_pos: dict[str, int] = {}
        self._format: PageFormat | None = None
        self._copies: dict[int, list[torch.Tensor | None]] = {}
        self._failed: set[int] = set()

    # -- setup -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        found = [(name, cache) for name, cache in kv_caches.items() if isinstance(cache, torch.Tensor)]
        order = sorted(range(len(found)), key=lambda i: _layer_index(found[i][0], i))
        named = [found[i] for i in order]
        if len(named) != self.layout.num_layers:
            raise ConfigError(
                f"vLLM registered {len(named)} KV caches for a {self.layout.num_layers}-layer layout"
            )
        for name, cache in named:
            if cache.dim() != 4 or cache.shape[2] != self.layout.block_tokens:
                raise ConfigError(
                    f"KV cache of {name} has shape {tuple(cache.shape)}; expected [blocks, heads, "
                    f"{self.layout.block_tokens}, content]"
                )
        self.layers = named
        self._layer_pos = {name: i for i, (name, _) in enumerate(named)}

    def page_format(self) -> PageFormat:
        """How K and V lie in a page, learned once from the attention backend (see PageFormat)."""
        if self._format is None:
            name, cache = self.layers[0]
            layer = None
            try:
                context = self.vllm_config.compilation_config.static_forward_context
                layer = context.get(name)
            except AttributeError:
                pass
            fmt = (
                PageFormat.probe(layer, cache, self.layout.head_dim, self.layout.block_tokens)
                if layer
                else None
            )
            if fmt is None:
                fmt = PageFormat.dense(tuple(cache.shape[1:]), self.layout.head_dim)  # type: ignore[arg-type]
            log.info("kvstrata: KV page format %s, page shape %s", fmt.source, fmt.page_shape)
            EVENTS.page_format = fmt.source
            self._format = fmt
        return self._format

    # -- loads -----------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVStrataConnectorMetadata) -> None:
        if not meta.loads:
            return
        fmt = self.page_format()
        bt = self.layout.block_tokens
        for spec in meta.loads:
            try:
                n = len(spec.page_ids)
                kv = spec.kv
                for layer_idx, (_, cache) in enumerate(self.layers):
                    ids = torch.tensor(spec.page_ids, dtype=torch.long, device=cache.device)
                    # (2, H, n*bt, D) -> (n, 2, H, bt, D)
                    per_layer = (
                        kv[:, layer_idx].reshape(2, kv.shape[2], n, bt, kv.shape[4]).permute(2, 0, 1, 3, 4)
                    )
                    per_layer = per_layer.to(cache.device)
                    if all(fmt.write_page(cache[pid], per_layer[j]) for j, pid in enumerate(spec.page_ids)):
                        continue  # written in place, page by page
                    pages = cache[ids].contiguous()  # keeps any page padding as it is
                    fmt.blocks_to_pages(per_layer, pages)
                    cache[ids] = pages
                EVENTS.blocks_loaded += n
            except Exception:
                EVENTS.load_errors += 1
                self._failed.update(spec.page_ids)
                log.exception(
                    "kvstrata: loading %d blocks of %s failed; vLLM recomputes them", n, spec.req_id
                )

    def take_failed(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    # -- saves -----------------------------------------------------------------------------------
    def save_kv_layer(self, meta: KVStrataConnectorMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not meta.saves:
            return
        pos = self._layer_pos.get(layer_name)
        if pos is None:
            return
        for i, spec in enumerate(meta.saves):
            copies = self._copies.setdefault(i, [None] * len(self.layers))
            ids = torch.tensor(spec.page_ids, dtype=torch.long, device=kv_layer.device)
            copies[pos] = kv_layer[ids]  # advanced indexing copies: the only work on the forward path

    def wait_for_save(self, meta: KVStrataConnectorMetadata) -> None:
        copies, self._copies = self._copies, {}
        if not meta.saves:
            return
        fmt = self.page_format()
        for i, spec in enumerate(meta.saves):
            layer_pages = copies.get(i)
            if layer_pages is None or any(p is None for p in layer_pages):
                continue  # a layer was not saved this step (no attention metadata): skip, never half-store
            self.saver.submit(spec, [p for p in layer_pages if p is not None], fmt)
