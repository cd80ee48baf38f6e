"""The worker side: moving blocks between vLLM's paged KV cache and the store, in each worker.

Every worker (one per tensor-parallel rank) opens the store itself and moves only its own shard
(``ranks.rank_key``); the scheduler side sends keys and page ids, never KV.

* Loads: each block is read through the store's normal read path (memory tiers, then L3, then L4;
  every byte verified: CRC32C, key, layout) and written into the request's pages of every layer.
  Asynchronous loads run in a background thread (:class:`BlockLoader`) while the engine computes
  other requests; the request is reported done through ``get_finished``. Synchronous loads run in
  ``start_load_kv`` before the forward pass. A block that is missing, damaged or foreign (the
  store quarantines damaged files) is never written into a page: its page and every later page of
  that load are reported to vLLM (``get_block_ids_with_load_errors``), which recomputes them.
* Saves: after each layer's attention, ``save_kv_layer`` copies the pages of the blocks to save out
  of that layer's cache (the only work on the forward path). ``wait_for_save`` hands the copies to
  a background thread (:class:`BlockSaver`), which turns them into kvstrata blocks and puts them in
  the store; the store's own background writer then writes them to L3 (and L4).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from kvstrata.errors import ConfigError
from kvstrata.integrations.vllm.events import EVENTS
from kvstrata.integrations.vllm.layout import PageFormat
from kvstrata.integrations.vllm.metadata import KVStrataConnectorMetadata, LoadSpec
from kvstrata.integrations.vllm.ranks import rank_key
from kvstrata.integrations.vllm.saver import BlockLoader, BlockSaver, FailedKeys, to_background
from kvstrata.priority import Priority
from kvstrata.store import KVStore

log = logging.getLogger(__name__)


def _layer_index(name: str, fallback: int) -> int:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return int(extract_layer_index(name))
    except Exception:
        return fallback


class WorkerSide:
    def __init__(self, store: KVStore, vllm_config: Any, rank: int = 0, tp_size: int = 1) -> None:
        self.store = store
        self.layout = store.layout
        self.vllm_config = vllm_config
        self.rank = rank
        self.tp_size = tp_size
        self.failed_keys = FailedKeys()
        self.saver = BlockSaver(store, rank, tp_size, self.failed_keys)
        self.loader = BlockLoader(self._load)
        self.layers: list[tuple[str, torch.Tensor]] = []
        self._layer_pos: dict[str, int] = {}
        self._format: PageFormat | None = None
        self._format_lock = threading.Lock()
        self._allocated: torch.Tensor | None = None
        self._copies: dict[int, list[torch.Tensor | None]] = {}
        self._failed_pages: set[int] = set()
        self._failed_lock = threading.Lock()
        self._unsaved_requests: set[str] = set()
        self._lowered: set[int] = set()
        self._lower_store_threads()

    def _lower_store_threads(self) -> None:
        """The store's background threads in this process (its L3 and L4 writers, demoter,
        re-encoder) run at ``BACKGROUND_NICE`` too; the loader does not (a request waits on it)."""
        for thread in threading.enumerate():
            ident = thread.native_id
            if (
                ident is not None
                and ident not in self._lowered
                and thread.name.startswith("kvstrata-")
                and thread is not self.loader.thread
                and to_background(thread)
            ):
                self._lowered.add(ident)

    def close(self, deadline: float | None = None) -> int:
        """Finish the loads and saves in flight (until ``deadline``); the blocks not saved."""
        self.loader.close(deadline)
        return self.saver.close(deadline)

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
        self._allocated = named[0][1] if named else None
        # an fp8 cache is allocated as uint8: viewed as the fp8 it holds, its pages copy byte for byte
        self.layers = [(name, self._typed(cache)) for name, cache in named]
        if self.layout.fp8:
            self.page_format()  # an fp8 cache the probe cannot read is refused at start, not at a save
        self._layer_pos = {name: i for i, (name, _) in enumerate(named)}

    def _typed(self, cache: torch.Tensor) -> torch.Tensor:
        dtype = self.layout.torch_dtype
        return cache.view(dtype) if self.layout.fp8 and cache.dtype != dtype else cache

    def page_format(self) -> PageFormat:
        """How K and V lie in a page, learned once from the attention backend (see PageFormat)."""
        with self._format_lock:
            if self._format is None:
                self._format = self._probe_format()
            return self._format

    def _probe_format(self) -> PageFormat:
        name, cache = self.layers[0]
        allocated = self._allocated if self._allocated is not None else cache
        layer = None
        try:
            context = self.vllm_config.compilation_config.static_forward_context
            layer = context.get(name)
        except AttributeError:
            pass
        fmt = None
        if layer is not None:
            inputs = self.vllm_config.model_config.dtype if self.layout.fp8 else None
            geometry = (self.layout.head_dim, self.layout.block_tokens)
            fmt = PageFormat.probe(layer, allocated, *geometry, elements=cache.dtype, inputs=inputs)
        if fmt is None and self.layout.fp8:
            # dense pages are a guess; for fp8 the probe also checks the format (E4M3 or E5M2)
            raise ConfigError(
                f"kvstrata could not learn where vLLM's attention backend puts K and V in its "
                f"{self.layout.dtype} KV cache pages, nor check their format; not storing them"
            )
        if fmt is None:
            fmt = PageFormat.dense(tuple(cache.shape[1:]), self.layout.head_dim)  # type: ignore[arg-type]
        log.info("kvstrata: KV page format %s, page shape %s", fmt.source, fmt.page_shape)
        EVENTS.page_format = fmt.source
        return fmt

    # -- loads -----------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVStrataConnectorMetadata) -> None:
        for spec in meta.loads:
            if spec.is_async:
                self.loader.submit(spec)
            else:
                failed = self._load(spec)
                if failed:
                    # this step computes the rest of the prompt on top of a page that was not
                    # written: none of the request's blocks of this step may be saved
                    self._unsaved_requests.add(spec.req_id)
                    with self._failed_lock:
                        self._failed_pages.update(failed)

    def _load(self, spec: LoadSpec) -> list[int]:
        """Write the blocks of ``spec`` into its pages; the pages that were not written."""
        priority = Priority.parse(spec.priority)
        for i, key in enumerate(spec.keys):
            shard = rank_key(key, self.rank, self.tp_size)
            try:
                self.saver.flush([key])  # this worker may still be saving it
                found = self.store.blocks.lookup(shard, priority=priority)
                if found is None:
                    raise LookupError("not in the store, or it failed verification (the store logs why)")
                block, _ = found
                self._write(spec.page_ids[i], block.decoded(self.layout))
            except Exception as exc:
                failed = spec.page_ids[i:]
                self.failed_keys.add(spec.keys[i:])
                EVENTS.emit(
                    "load_error",
                    blocks=len(failed),
                    req_id=spec.req_id,
                    rank=self.rank,
                    key=shard.hex(),
                    error=str(exc),
                )
                log.warning(
                    "kvstrata: block %s of %s could not be loaded (%s); vLLM recomputes its %d "
                    "page(s) from there",
                    shard.hex()[:16],
                    spec.req_id,
                    exc,
                    len(failed),
                )
                if i:
                    EVENTS.emit("load", blocks=i, req_id=spec.req_id, rank=self.rank, is_async=spec.is_async)
                return failed
        EVENTS.emit("load", blocks=len(spec.keys), req_id=spec.req_id, rank=self.rank, is_async=spec.is_async)
        return []

    def _write(self, page_id: int, block: torch.Tensor) -> None:
        """One ``(2, L, H, N, D)`` block into page ``page_id`` of every layer."""
        fmt = self.page_format()
        for layer_idx, (_, cache) in enumerate(self.layers):
            data = block[:, layer_idx].to(cache.device)
            if fmt.write_page(cache[page_id], data):
                continue  # written in place
            ids = torch.tensor([page_id], dtype=torch.long, device=cache.device)
            pages = cache[ids].contiguous()  # keeps any page padding as it is
            fmt.blocks_to_pages(data.unsqueeze(0), pages)
            cache[ids] = pages

    def get_finished(self) -> set[str]:
        """Requests whose asynchronous load is done; their failed pages are reported by the next
        :meth:`take_failed_pages` (vLLM asks for both in the same pass, finished first)."""
        done = self.loader.take_done()
        with self._failed_lock:
            for _, failed in done:
                self._failed_pages.update(failed)
        return {req_id for req_id, _ in done}

    def take_failed_pages(self) -> set[int]:
        with self._failed_lock:
            failed, self._failed_pages = self._failed_pages, set()
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
            # advanced indexing copies: the only work on the forward path. An fp8 cache is indexed
            # as fp8: torch's index of a uint8 tensor took 0.41 ms for 16 pages of 64 KiB, of the
            # same bytes viewed as float8 0.02 ms (bf16's 0.14 ms)
            copies[pos] = self._typed(kv_layer)[ids]

    def wait_for_save(self, meta: KVStrataConnectorMetadata) -> None:
        copies, self._copies = self._copies, {}
        unsaved, self._unsaved_requests = self._unsaved_requests, set()
        if not meta.saves:
            return
        fmt = self.page_format()
        self._lower_store_threads()  # a writer the store started since (L4's, lazily)
        for i, spec in enumerate(meta.saves):
            layer_pages = copies.get(i)
            if spec.req_id in unsaved or layer_pages is None or any(p is None for p in layer_pages):
                # computed over a page that failed to load, or a layer was not saved this step:
                # never store it; the scheduler side plans the save again after the recompute
                self.failed_keys.add(spec.keys)
                continue
            self.saver.submit(spec, [p for p in layer_pages if p is not None], fmt)
