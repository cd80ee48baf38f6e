"""Building a store's tiers from its configuration: L1 and L2 in this process's memory, L3 under
the store's root (with its evictor when bounded), L4 on Redis."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvstrata.config import StoreConfig
from kvstrata.crypto import Keyring
from kvstrata.layout import KVLayout
from kvstrata.store.compaction import Compactor
from kvstrata.store.index import Index
from kvstrata.store.processes import ProcessRegistry
from kvstrata.store.tiers.base import Tier
from kvstrata.store.tiers.device import DeviceTier
from kvstrata.store.tiers.disk import DiskTier, open_disk_tier
from kvstrata.store.tiers.disk.cold_dir import resolve_cold_dir
from kvstrata.store.tiers.disk.evictor import Evictor
from kvstrata.store.tiers.host import HostTier
from kvstrata.store.tiers.remote import RedisTier


def build_tiers(
    root: Path,
    layout: KVLayout,
    index: Index,
    config: StoreConfig,
    *,
    read_only: bool = False,
    processes: ProcessRegistry | None = None,
    evictor: Callable[[RedisTier | None], Evictor | None] = lambda remote: None,
) -> tuple[list[Tier], DiskTier, RedisTier | None]:
    """The tiers ``config`` asks for: L1 on ``config.device`` and the L2 arena (empty when their
    budget is 0), L3 in ``root``, and L4 on Redis for a writable store with a remote tier.
    ``processes``: this process's registration (names its temp files, tells whose are dead);
    ``evictor``: the bounded L3's evictor, given the remote tier (None: L3 refuses writes past
    its budget). The cold tier lies in ``config.cold_dir`` or the one the store recorded
    (:mod:`~kvstrata.store.tiers.disk.cold_dir`)."""
    keyring = Keyring(config.encryption_key) if config.encryption_key is not None else None
    memory: list[Tier] = [
        DeviceTier(layout, config.l1_budget_bytes, config.device),
        HostTier(layout, config.l2_budget_bytes, pin_memory=config.pin_host_memory),
    ]
    remote = (
        RedisTier(config.remote, layout, keyring) if config.remote is not None and not read_only else None
    )
    cold_dir = resolve_cold_dir(root, config.cold_dir, read_only=read_only)
    disk = open_disk_tier(
        root,
        layout,
        index,
        budget_bytes=config.l3_budget_bytes,
        evictor=evictor(remote),
        read_only=read_only,
        keyring=keyring,
        writer_token=processes.token if processes is not None else "",
        writer_nonce=processes.nonce if processes is not None else "00000000",
        alive=processes.alive if processes is not None else None,
        direct_writes=config.l3_direct_writes,
        direct_reads=config.l3_direct_reads,
        compactor=lambda *parts: Compactor(*parts).compact_segments,
        cold_dir=cold_dir,
    )
    return memory, disk, remote
