"""``KVStrataConnector``: kvstrata's store as a vLLM (V1) KV connector.

Register it with::

    KVTransferConfig(kv_connector="KVStrataConnector",
                     kv_connector_module_path="kvstrata.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"store_dir": "/var/lib/kvstrata", ...})

vLLM constructs it twice, once per role; both roles of one process share one store. The
scheduler role decides (``scheduler.SchedulerSide``), the worker role moves bytes
(``worker.WorkerSide``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstrata.integrations.vllm import shared
from kvstrata.integrations.vllm.config import ConnectorConfig
from kvstrata.integrations.vllm.layout import layout_from_vllm, model_fingerprint
from kvstrata.integrations.vllm.metadata import KVStrataConnectorMetadata
from kvstrata.integrations.vllm.scheduler import SchedulerSide
from kvstrata.integrations.vllm.worker import BlockSaver, WorkerSide
from kvstrata.store.tiers.base import TierLevel

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVStrataConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = ConnectorConfig.from_extra_config(extra)
        self.layout = layout_from_vllm(vllm_config, kv_cache_config)
        self.fingerprint = model_fingerprint(vllm_config, self.config.model_fingerprint)
        self.store = shared.acquire(self.config.store_dir, self.layout, self.fingerprint, self.config.store)
        self._closed = False
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._saver: BlockSaver | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, self.store)
        else:
            self._saver = BlockSaver(self.store)
            shared.register_saver(self.store, self._saver)
            self._worker = WorkerSide(self.store, vllm_config, self._saver)
        log.info(
            "kvstrata connector (%s): store %s, layout %s, model %s",
            role.name,
            self.store.root,
            self.layout.describe(),
            self.fingerprint.hex()[:16],
        )

    # -- worker side -----------------------------------------------------------------------------
    def _meta(self) -> KVStrataConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStrataConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            self._worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads and saves finish within their step

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed() if self._worker is not None else set()

    # -- scheduler side --------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        if num_external_tokens == 0 or self._scheduler is None:
            return {}
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        by_tier = self._scheduler.external_hit_tiers(request)
        sources = {
            CacheHitSource.HOST: by_tier.get(TierLevel.L1, 0) + by_tier.get(TierLevel.L2, 0),
            CacheHitSource.DISK: by_tier.get(TierLevel.L3, 0),
            CacheHitSource.EXTERNAL_UNSPECIFIED: by_tier.get(TierLevel.L4, 0),
        }
        sources = {k: v for k, v in sources.items() if v}
        if sum(sources.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return sources

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- lifecycle -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._saver is not None:
            self._saver.close()
        shared.release(self.store)
