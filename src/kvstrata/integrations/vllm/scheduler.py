"""The scheduler side: which tokens the store can supply, and which blocks to save.

For a new request it keys the full blocks of its tokens with kvstrata's chained keys (model
fingerprint, layout, namespace = the request's ``cache_salt`` or the configured namespace), then
reads the blocks that vLLM does not already hold locally through the store's normal read path
(every tier, L4 first fetched in one pipelined round trip). Reading them here, not just looking
them up, means every byte is verified (CRC32C, key, layout) before vLLM is told about a hit: a
corrupt or foreign block ends the hit where it lies, and the request recomputes from there. Only
the blocks that are needed are read. The last prompt token is always left to compute.

Each step it names, per request, the full blocks that become complete in that step and that the
store does not hold yet; the worker side copies exactly those pages out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata.integrations.vllm.config import ConnectorConfig
from kvstrata.integrations.vllm.metadata import KVStrataConnectorMetadata, LoadSpec, SaveSpec
from kvstrata.integrations.vllm.shared import EVENTS, flush_saves
from kvstrata.keys import BlockKey, chain_key
from kvstrata.priority import Priority
from kvstrata.store import KVStore
from kvstrata.store.tiers.base import TierLevel

log = logging.getLogger(__name__)

PRIORITY_PARAM = "kvstrata_priority"
"""Per-request priority class: ``SamplingParams(extra_args={"kv_transfer_params":
{"kvstrata_priority": "background"}})``."""


@dataclass
class _PendingLoad:
    first_block: int
    num_blocks: int
    kv: torch.Tensor
    tokens_by_tier: dict[TierLevel, int]


@dataclass
class _RequestState:
    request: Any
    namespace: str
    priority: Priority
    keys: list[BlockKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    pending: _PendingLoad | None = None
    to_load: _PendingLoad | None = None
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


def _with_remote(by_tier: dict[TierLevel, int], remote_tokens: int) -> dict[TierLevel, int]:
    """Tokens per tier, with the ``remote_tokens`` that a prefetch just brought from L4 (the load
    then found them in a local tier) counted as L4."""
    out = dict(by_tier)
    for level in (TierLevel.L1, TierLevel.L2, TierLevel.L3):
        take = min(out.get(level, 0), remote_tokens)
        if take:
            out[level] -= take
            remote_tokens -= take
            out[TierLevel.L4] = out.get(TierLevel.L4, 0) + take
    return {level: n for level, n in out.items() if n}


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, store: KVStore) -> None:
        self.config = config
        self.store = store
        self.layout = store.layout
        self.block_tokens = store.layout.block_tokens
        self._requests: dict[str, _RequestState] = {}

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
        if st.pending is not None and st.pending.first_block == first:
            return st.pending.num_blocks * bt, False  # asked again (not scheduled last time)
        keys = self._keys_upto(st, usable)[first:]
        flush_saves(self.store, keys)  # blocks that earlier steps are still saving: wait for them
        remote: set[BlockKey] = set()
        if self.store.has_remote:
            # one pipelined round trip for every block no local tier holds
            remote = {k for k in keys if not self.store.contains(k)}
            if not self.store.prefetch_remote(keys):
                remote = set()
        loaded = self.store.load_blocks(keys, priority=st.priority)
        num_blocks = loaded.num_tokens // bt
        by_tier = _with_remote(loaded.tokens_by_tier, bt * sum(k in remote for k in keys[:num_blocks]))
        self._record(request, st, num_computed_tokens, num_blocks * bt, by_tier)
        if num_blocks == 0 or loaded.kv is None:
            st.pending = None
            return 0, False
        kv = loaded.kv[:, :, :, : num_blocks * bt]
        st.pending = _PendingLoad(first, num_blocks, kv, by_tier)
        return num_blocks * bt, False

    def _record(
        self, request: Any, st: _RequestState, local: int, external: int, by_tier: dict[TierLevel, int]
    ) -> None:
        EVENTS.lookups.append(
            {
                "req_id": request.request_id,
                "namespace": st.namespace,
                "num_tokens": len(request.all_token_ids),
                "local_tokens": local,
                "external_tokens": external,
                "tokens_by_tier": {level.name: n for level, n in by_tier.items()},
            }
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None:
            return
        pending, st.pending = st.pending, None
        if num_external_tokens <= 0 or pending is None:
            return
        bt = self.block_tokens
        num_blocks = min(pending.num_blocks, -(-num_external_tokens // bt))
        st.to_load = _PendingLoad(
            pending.first_block, num_blocks, pending.kv[:, :, :, : num_blocks * bt], pending.tokens_by_tier
        )
        st.saved_upto = max(st.saved_upto, pending.first_block + num_blocks)

    def external_hit_tiers(self, request: Any) -> dict[TierLevel, int]:
        st = self._requests.get(request.request_id)
        if st is None or st.to_load is None:
            return {}
        return dict(st.to_load.tokens_by_tier)

    def build_connector_meta(self, scheduler_output: Any) -> KVStrataConnectorMetadata:
        meta = KVStrataConnectorMetadata()
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
            pages = st.block_ids[load.first_block : load.first_block + load.num_blocks]
            if len(pages) == load.num_blocks:
                meta.loads.append(LoadSpec(req_id, pages, load.kv))
            else:  # cannot happen with vLLM's allocator; never load into the wrong pages
                log.error(
                    "kvstrata: request %s has %d pages for %d blocks", req_id, len(pages), load.num_blocks
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
        todo = [j for j in range(st.saved_upto, full) if not self.store.contains(keys[j])]
        st.saved_upto = full
        if todo:
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

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None  # saves copy pages out within the step: the blocks may be freed at once
