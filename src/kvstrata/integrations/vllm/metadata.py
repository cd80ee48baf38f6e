"""What the scheduler side tells the worker side for one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Write ``kv`` (``(2, L, H, n * block_tokens, D)``, already read and verified from the store)
    into the pages ``page_ids`` (one per block) before this step's forward pass."""

    req_id: str
    page_ids: list[int]
    kv: torch.Tensor


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
