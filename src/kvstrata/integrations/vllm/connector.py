"""``KVStrataConnector``: kvstrata's store as a vLLM (V1) KV connector.

Register it with::

    KVTransferConfig(kv_connector="KVStrataConnector",
                     kv_connector_module_path="kvstrata.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"store_dir": "/var/lib/kvstrata", ...})

vLLM constructs it once per role and process: the scheduler role in the EngineCore process
(``scheduler.SchedulerSide``: which blocks the store holds, which to save; it never reads KV), the
worker role in each worker, one per tensor-parallel rank (``worker.WorkerSide``: loads and saves
its own shard). Each process opens the store itself (``shared``); only keys and page ids pass
between them, in vLLM's connector metadata.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvstrata.integrations.vllm import shared
from kvstrata.integrations.vllm.config import ConnectorConfig
from kvstrata.integrations.vllm.events import EVENTS
from kvstrata.integrations.vllm.layout import layout_from_vllm, model_fingerprint, tensor_parallel_size
from kvstrata.integrations.vllm.metadata import KVStrataConnectorMetadata, KVStrataWorkerMetadata
from kvstrata.integrations.vllm.scheduler import DISK, HOST, REMOTE, SchedulerSide
from kvstrata.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

SAVE_SHARE = 0.75
"""The share of ``drain_timeout_s`` a process's connector spends finishing its saves on a stop."""


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KVStrataConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = ConnectorConfig.from_extra_config(extra)
        self.layout = layout_from_vllm(vllm_config, kv_cache_config)
        self.fingerprint = model_fingerprint(vllm_config, self.config.model_fingerprint)
        self.tp_size = tensor_parallel_size(vllm_config)
        self._closed = False
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        path = self.config.store_path(self.layout)
        is_scheduler = role == KVConnectorRole.SCHEDULER
        self.store = shared.acquire(
            path, self.layout, self.fingerprint, self.config.store, memory=not is_scheduler
        )
        rank = 0
        if is_scheduler:
            EVENTS.configure(self.config.event_log)
            self._scheduler = SchedulerSide(self.config, self.store, self.tp_size)
            self._set_load_failure_policy()
        else:
            rank = _tp_rank() if self.tp_size > 1 else 0
            EVENTS.configure(self.config.event_log)
            self._worker = WorkerSide(self.store, vllm_config, rank, self.tp_size)
            shared.on_close(self.store, self._worker)
        log.info(
            "kvstrata connector (%s%s): store %s, layout %s, model %s",
            role.name,
            f", rank {rank} of {self.tp_size}" if self.tp_size > 1 else "",
            self.store.root,
            self.layout.describe(),
            self.fingerprint.hex()[:16],
        )

    def _set_load_failure_policy(self) -> None:
        """vLLM reads ``kv_load_failure_policy`` right after it builds the scheduler's connector.
        Its default, ``fail``, is meant for transfers whose KV exists nowhere else; for a cache, a
        block that fails to load is a miss, so the connector asks vLLM to recompute it (unless
        ``on_load_error`` says ``fail``)."""
        current = getattr(self._kv_transfer_config, "kv_load_failure_policy", None)
        if current is not None and current != self.config.on_load_error:
            log.info(
                "kvstrata: vLLM's kv_load_failure_policy %r set to %r (on_load_error)",
                current,
                self.config.on_load_error,
            )
            self._kv_transfer_config.kv_load_failure_policy = self.config.on_load_error

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
        return  # synchronous loads were written into every layer before the forward pass

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
        if self._worker is None:
            return None, None
        return None, self._worker.get_finished() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_pages() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        failed = self._worker.failed_keys.take()
        return KVStrataWorkerMetadata(failed) if failed else None

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

        names = {
            HOST: CacheHitSource.HOST,
            DISK: CacheHitSource.DISK,
            REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED,  # vLLM has no label for a shared remote store
        }
        sources: dict[Any, int] = {}
        for name, tokens in self._scheduler.hit_sources(request).items():
            sources[names[name]] = sources.get(names[name], 0) + tokens
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

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- lifecycle -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """vLLM's stop (each process, when its engine or worker shuts down): the saves in flight
        are finished, within ``drain_timeout_s`` (see :mod:`kvstrata.integrations.vllm.shared`)."""
        if self._closed:
            return
        self._closed = True
        # a quarter of the time is left to vLLM's own teardown of the processes
        shared.release(self.store, SAVE_SHARE * self.config.drain_timeout_s)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        """Called by vLLM in its API server process (its Prometheus logger): the one connector hook
        that runs there, where vLLM decides how long a stop may take (see :func:`drain_on_stop`).
        The connector registers no metrics of its own (its counters are in the event log)."""
        drain_on_stop(vllm_config)
        return None


def drain_on_stop(vllm_config: Any) -> None:
    """Give a stop of vLLM's API server the time to finish the connector's saves.

    vLLM 0.32's API server, on SIGTERM or SIGINT, stops its engine process and waits
    ``shutdown_timeout`` seconds (``--shutdown-timeout``) before it kills it and its workers with
    SIGKILL. Its default, 0, kills them at once: the blocks the workers were still saving (the
    last answer's) are lost. When it is 0, it is raised to the connector's ``drain_timeout_s`` (as
    ``--shutdown-timeout N`` would): vLLM's engine then stops its requests (0 in its own process
    still means: abort them), every worker's connector finishes its saves, and the processes exit
    on their own, at most that long after the signal. A ``--shutdown-timeout`` above 0 is kept;
    ``drain_timeout_s: 0`` leaves vLLM's as it is."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None or getattr(vllm_config, "shutdown_timeout", None) != 0:
        return
    config = ConnectorConfig.from_extra_config(dict(transfer.kv_connector_extra_config or {}))
    if config.drain_timeout_s <= 0:
        return
    vllm_config.shutdown_timeout = math.ceil(config.drain_timeout_s)
    log.warning(
        "kvstrata: vLLM's shutdown timeout raised from 0 to %d s (drain_timeout_s), so that a stop "
        "finishes the saves in flight; pass --shutdown-timeout to choose another",
        vllm_config.shutdown_timeout,
    )
