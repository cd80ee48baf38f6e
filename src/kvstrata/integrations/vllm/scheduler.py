"""The scheduler side: what the store holds for a request, and which blocks the workers save.

It runs in vLLM's EngineCore process and never reads KV. For a new request it keys the full
blocks of its tokens with kvstrata's chained keys (model fingerprint, layout, namespace = the
request's ``cache_salt`` or the configured namespace) and counts the run of blocks, from the first
one vLLM does not hold itself, that the store holds for *every* tensor-parallel rank:

* blocks this server's workers were told to save (they hold them in memory, or are still saving
  them: a worker's load waits for its own pending save of that block);
* blocks in the store's index (L3: written by this server, an earlier run or another replica);
* with a remote tier, the blocks no local tier holds are fetched from L4 in one pipelined round
  trip and written to L3 (``KVStore.blocks.prefetch_remote``); a worker that looks before that write
  lands reads them from L4 itself.

The last prompt token is always left to compute. The hit is only what the index says: a block
that turns out to be damaged, foreign or gone when a worker reads it is reported back to vLLM as
a load error, and vLLM recomputes from there (``worker.WorkerSide``). By default loads are
asynchronous: the request waits (``WAITING_FOR_REMOTE_KVS``) while its workers read, and the
engine keeps computing the others.

Each step it names, per request, the full blocks that become complete in that step and that the
store does not hold yet; the workers copy exactly those pages out and save them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvstrata.integrations.vllm.config import ConnectorConfig
from kvstrata.integrations.vllm.events import EVENTS
from kvstrata.integrations.vllm.metadata import (
    KVStrataConnectorMetadata,
    KVStrataWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvstrata.integrations.vllm.ranks import rank_keys
from kvstrata.keys import BlockKey, chain_key
from kvstrata.priority import Priority
from kvstrata.store import KVStore
from kvstrata.store.tiers.base import TierLevel

log = logging.getLogger(__name__)

PRIORITY_PARAM = "kvstrata_priority"
"""Per-request priority class: ``SamplingParams(extra_args={"kv_transfer_params":
{"kvstrata_priority": "background"}})``."""

HOST, DISK, REMOTE = "host", "disk", "remote"
"""Where a hit's blocks come from, as the scheduler sees it: the workers' memory (blocks this
server saved), the disk tier (L3), or the remote tier (L4, fetched by this lookup)."""

RECENT_SAVES = 1 << 16
"""Base keys of blocks this server saved that the scheduler remembers (a bounded LRU)."""


class _RecentKeys:
    """A bounded set of keys, oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)


@dataclass
class _Load:
    first_block: int
    keys: list[BlockKey]
    sources: list[str]
    is_async: bool
    page_ids: list[int] = field(default_factory=list)

    def tokens_by_source(self, block_tokens: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for source in self.sources:
            out[source] = out.get(source, 0) + block_tokens
        return out


@dataclass
class _RequestState:
    request: Any
    namespace: str
    priority: Priority
    keys: list[BlockKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    pending: _Load | None = None
    """The hit last reported to vLLM, until it allocates pages for it."""
    to_load: _Load | None = None
    """A synchronous load, sent with the step that schedules the request."""
    hit_sources: dict[str, int] = field(default_factory=dict)
    saved_upto: int = 0
    """Full blocks before this one are stored (or were checked to be)."""
    cacheable: bool = True
    """False for requests whose KV is not a function of (weights, token ids) alone."""


def _cacheable(request: Any) -> bool:
    """Token ids key a block only when they alone (with the weights) decide its KV: not with images
    or audio (their placeholder tokens are equal for different inputs), prompt embeddings, or a LoRA
    adapter (other weights). Such requests neither load nor save."""
    return not (
        getattr(request, "mm_features", None)
        or getattr(request, "prompt_embeds", None) is not None
        or getattr(request, "lora_request", None) is not None
    )


def _pages(req_id: str, block_ids: list[int], load: _Load) -> list[int]:
    """The pages ``load``'s blocks go to: one per block, from its first block on."""
    pages = block_ids[load.first_block : load.first_block + len(load.keys)]
    if len(pages) != len(load.keys):  # cannot happen with vLLM's allocator; never load into wrong pages
        raise RuntimeError(f"kvstrata: request {req_id} has {len(pages)} pages for {len(load.keys)} blocks")
    return pages


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, store: KVStore, tp_size: int = 1) -> None:
        self.config = config
        self.store = store
        self.tp_size = tp_size
        self.block_tokens = store.layout.block_tokens
        self._requests: dict[str, _RequestState] = {}
        self._saved = _RecentKeys(RECENT_SAVES)
        self._failed = _RecentKeys(RECENT_SAVES)
        """Base keys a worker failed to load or save: not held until saved again (this process's
        view of the index may still list a block another process quarantined or removed)."""
        self._async_ready: list[tuple[str, _Load, str]] = []
        self._loading: set[str] = set()
        """Requests with an asynchronous load the workers have not reported done."""

    # -- per-request state -----------------------------------------------------------------------
    def _namespace(self, request: Any) -> str:
        salt = getattr(request, "cache_salt", None)
        return salt if salt and "\x00" not in salt else self.config.namespace

    def _priority(self, request: Any) -> Priority:
        params = getattr(request, "kv_transfer_params", None) or {}
        value = params.get(PRIORITY_PARAM) if isinstance(params, dict) else None
        return Priority.parse(value) if value else self.config.priority

    def state(self, request: Any) -> _RequestState:
        st = self._requests.get(request.request_id)
        if st is None or st.request is not request:
            st = _RequestState(request, self._namespace(request), self._priority(request))
            st.cacheable = _cacheable(request)
            self._requests[request.request_id] = st
        return st

    def _keys_upto(self, st: _RequestState, num_blocks: int) -> list[BlockKey]:
        tokens = st.request.all_token_ids
        bt = self.block_tokens
        while len(st.keys) < num_blocks:
            i = len(st.keys)
            parent = st.keys[-1] if st.keys else self.store.root_key(st.namespace)
            st.keys.append(chain_key(parent, list(tokens[i * bt : (i + 1) * bt])))
        return st.keys[:num_blocks]

    # -- what the store holds --------------------------------------------------------------------
    def _stored_source(self, key: BlockKey) -> str | None:
        """Where the store holds every rank's shard of ``key`` (the outermost tier), or None."""
        levels = [self.store.blocks.where(shard) for shard in rank_keys(key, self.tp_size)]
        if any(level is None for level in levels):
            return None
        return HOST if all(level in (TierLevel.L1, TierLevel.L2) for level in levels) else DISK

    def held(self, key: BlockKey) -> str | None:
        """Where block ``key`` comes from if it is held for every rank, else None."""
        if key in self._failed:
            return None
        if key in self._saved:
            return HOST
        return self._stored_source(key)

    def _held_run(self, keys: list[BlockKey]) -> list[str]:
        """The sources of the leading run of ``keys`` that the store holds."""
        sources: list[str] = []
        fetched: set[BlockKey] | None = None
        for i, key in enumerate(keys):
            source = self.held(key)
            if source is None and fetched is None and self.store.blocks.has_remote:
                # one pipelined round trip for every shard of the rest that no local tier holds
                wanted = [shard for k in keys[i:] for shard in rank_keys(k, self.tp_size)]
                missing = [shard for shard in wanted if not self.store.blocks.contains(shard)]
                fetched = set(missing) if self.store.blocks.prefetch_remote(missing) else set()
                source = self._stored_source(key)
            if source is None:
                break
            if fetched and any(shard in fetched for shard in rank_keys(key, self.tp_size)):
                source = REMOTE
            sources.append(source)
        return sources

    # -- vLLM's scheduler-side calls -------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self.state(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self.state(request)
        if not st.cacheable:
            return 0, False
        bt = self.block_tokens
        usable = (len(request.all_token_ids) - 1) // bt  # the last token is always computed
        first = num_computed_tokens // bt
        if usable <= first:
            return 0, False
        keys = self._keys_upto(st, usable)[first:]
        sources = self._held_run(keys)
        n = len(sources)
        load = _Load(first, keys[:n], sources, self.config.load_async) if n else None
        st.pending = load
        EVENTS.emit(
            "lookup",
            req_id=request.request_id,
            namespace=st.namespace,
            num_tokens=len(request.all_token_ids),
            local_tokens=num_computed_tokens,
            external_tokens=n * bt,
            tokens_by_source=load.tokens_by_source(bt) if load else {},
            load_async=bool(load and load.is_async),
        )
        if load is None:
            return 0, False
        return n * bt, load.is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None:
            return
        load, st.pending = st.pending, None
        if num_external_tokens <= 0 or load is None:
            return
        bt = self.block_tokens
        n = min(len(load.keys), -(-num_external_tokens // bt))
        load.keys, load.sources = load.keys[:n], load.sources[:n]
        st.hit_sources = load.tokens_by_source(bt)
        st.saved_upto = max(st.saved_upto, load.first_block + n)
        if not load.is_async:
            st.to_load = load  # sent with the step that schedules the request (its pages known then)
            return
        load.page_ids = _pages(request.request_id, list(blocks.get_block_ids()[0]), load)
        self._async_ready.append((request.request_id, load, st.priority.value))

    def hit_sources(self, request: Any) -> dict[str, int]:
        st = self._requests.get(request.request_id)
        return dict(st.hit_sources) if st is not None else {}

    def build_connector_meta(self, scheduler_output: Any) -> KVStrataConnectorMetadata:
        meta = KVStrataConnectorMetadata()
        for req_id, load, priority in self._async_ready:
            meta.loads.append(LoadSpec(req_id, load.page_ids, [bytes(k) for k in load.keys], priority, True))
            self._loading.add(req_id)
        self._async_ready.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0]) if new.block_ids else []
            self._plan(st, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan(st, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0), meta)
        return meta

    def _plan(
        self,
        st: _RequestState,
        req_id: str,
        num_computed: int,
        num_scheduled: int,
        meta: KVStrataConnectorMetadata,
    ) -> None:
        bt = self.block_tokens
        if st.to_load is not None:
            load, st.to_load = st.to_load, None
            pages = _pages(req_id, st.block_ids, load)
            meta.loads.append(
                LoadSpec(req_id, pages, [bytes(k) for k in load.keys], st.priority.value, False)
            )
        request = st.request
        if not st.cacheable:
            return
        end = min(num_computed + num_scheduled, len(request.all_token_ids))
        if not self.config.save_decode_blocks:
            end = min(end, request.num_prompt_tokens)
        full = min(end // bt, len(st.block_ids))
        if full <= st.saved_upto:
            return
        keys = self._keys_upto(st, full)
        todo = [j for j in range(st.saved_upto, full) if self.held(keys[j]) is None]
        st.saved_upto = full
        if not todo:
            return
        for j in todo:
            self._failed.discard(bytes(keys[j]))
            self._saved.add(bytes(keys[j]))
        meta.saves.append(
            SaveSpec(
                req_id,
                [st.block_ids[j] for j in todo],
                [bytes(keys[j]) for j in todo],
                [j * bt for j in todo],
                st.namespace,
                st.priority.value,
            )
        )

    def update_connector_output(self, output: Any) -> None:
        for req_id in getattr(output, "finished_recving", None) or ():
            self._loading.discard(req_id)
        report = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(report, KVStrataWorkerMetadata) and report.failed_keys:
            self._forget(report.failed_keys)

    def _forget(self, failed: set[bytes]) -> None:
        """Blocks a worker could not load or save are no longer held; a running request saves
        them again once vLLM has recomputed them."""
        for key in failed:
            self._saved.discard(key)
            self._failed.add(key)
        for st in self._requests.values():
            for j in range(min(st.saved_upto, len(st.keys))):
                if bytes(st.keys[j]) in failed:
                    st.saved_upto = j
                    break

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        # saves copy their pages out within the step, so the pages may be freed at once; an
        # asynchronous load still writing into them keeps them until the workers report it done
        return request.request_id in self._loading, None
