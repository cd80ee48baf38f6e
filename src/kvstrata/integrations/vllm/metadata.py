"""What the scheduler side tells the workers each engine step, and what they tell it back.

Only keys and page ids cross the process boundary (vLLM serialises this metadata from the
EngineCore process to every worker): each worker reads and writes the KV itself, through its own
store. Keys are *base* keys; a worker stores and loads its tensor-parallel shard under
``ranks.rank_key``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadSpec:
    """Read blocks ``keys`` from the store and write them into the pages ``page_ids`` (one per
    block). ``is_async``: in the background, the request waiting (vLLM's
    ``WAITING_FOR_REMOTE_KVS``) until the worker reports it done; else before this step's forward
    pass, which computes the rest of the prompt on top of them. A block that cannot be read intact
    is reported with its page and every later one (``get_block_ids_with_load_errors``)."""

    req_id: str
    page_ids: list[int]
    keys: list[bytes]
    priority: str
    is_async: bool


@dataclass
class SaveSpec:
    """Copy the pages ``page_ids`` out after each layer's attention and store them as the blocks
    ``keys`` (full blocks that become complete in this step and that the store does not hold)."""

    req_id: str
    page_ids: list[int]
    keys: list[bytes]
    start_positions: list[int]
    namespace: str
    priority: str


@dataclass
class KVStrataConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class KVStrataWorkerMetadata(KVConnectorWorkerMetadata):
    """Base keys whose save or load failed on some rank since the last step: the scheduler side
    stops counting them as held (vLLM merges the reports of every rank with :meth:`aggregate`)."""

    failed_keys: set[bytes] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVStrataWorkerMetadata):
            return KVStrataWorkerMetadata(self.failed_keys | other.failed_keys)
        return self
