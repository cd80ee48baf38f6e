"""Opening a store: its parts built in order, each handed what it uses.

The tiers first (:func:`~kvstrata.store.tiers.building.build_tiers`; a bounded L3 gets its
evictor), then the placement over them (:class:`~kvstrata.store.placement.TieredStore`), then the
parts ``KVStore`` is a façade of: the session catalogue with its leases, session I/O, block
access, documents, statistics, maintenance (gc) and archives. The only late binding: the evictor
asks the catalogue (built after the tiers) which blocks this process's sessions still need.
Every session commit and deletion is also written to this process's session journal
(:mod:`.recovery.journal`, what a rebuild of the index reads), opened once the disk tier's files
exist (they learn the store's id from it); gc asks :mod:`.recovery.guard` what it may delete.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from kvstrata.config import StoreConfig
from kvstrata.crypto import Keyring
from kvstrata.keys import BlockKey, root_key
from kvstrata.layout import KVLayout
from kvstrata.store.archive import Archives
from kvstrata.store.block_access import BlockAccess
from kvstrata.store.block_stats import BlockStatsTable, kept_for
from kvstrata.store.catalog import SessionCatalog
from kvstrata.store.counters import StoreCounters
from kvstrata.store.documents import SessionDocuments
from kvstrata.store.index import Index
from kvstrata.store.leases import Leases
from kvstrata.store.lifecycle import Maintenance
from kvstrata.store.placement import TieredStore
from kvstrata.store.processes import ProcessRegistry
from kvstrata.store.recovery.guard import gc_guard
from kvstrata.store.recovery.journal import SessionJournal
from kvstrata.store.recovery.merge import merge_journal
from kvstrata.store.recovery.opening import open_journal
from kvstrata.store.session_io import SessionIO
from kvstrata.store.stats import StoreStatistics
from kvstrata.store.tiers.building import build_tiers
from kvstrata.store.tiers.disk import DiskTier
from kvstrata.store.tiers.disk.evictor import Evictor
from kvstrata.store.tiers.remote import RedisTier


@dataclass(frozen=True, slots=True)
class StoreParts:
    tiered: TieredStore
    disk: DiskTier
    sessions: SessionCatalog
    io: SessionIO
    blocks: BlockAccess
    documents: SessionDocuments
    statistics: StoreStatistics
    maintenance: Maintenance
    archives: Archives
    journal: SessionJournal


def open_parts(
    root: Path,
    index: Index,
    config: StoreConfig,
    *,
    model_fingerprint: bytes,
    processes: ProcessRegistry | None,
) -> StoreParts:
    """The parts of the store at ``root`` (``processes``: this process's registration; None for
    a read-only store, which changes nothing)."""
    layout: KVLayout = index.layout
    read_only = processes is None
    stats = BlockStatsTable(kept_for(config.l1_budget_bytes + config.l2_budget_bytes, layout.bytes_per_block))
    counters = StoreCounters()
    catalog: SessionCatalog | None = None

    def live_keys() -> list[BlockKey]:
        """What eviction keeps: the keys this process's sessions use, and those other live
        processes pinned (blocks their sessions borrowed before a checkpoint names them)."""
        own = catalog.live_keys() if catalog is not None else []
        alive = processes.alive if processes is not None else None
        return own + [BlockKey(key) for key in index.leases.live_pins(alive)] if alive is not None else own

    def evictor(remote: RedisTier | None) -> Evictor | None:
        bounded = config.l3_budget_bytes is not None or any(
            q.l3_bytes is not None for q in config.namespace_quotas.values()
        )
        if read_only or not bounded:
            return None
        held = remote.contains_many if remote is not None else None
        return Evictor(
            index.blocks,
            index.sessions,
            root,
            config,
            stats,
            counters,
            live_keys=live_keys,
            held_remotely=held,
        )

    memory, disk, remote = build_tiers(
        root, layout, index, config, read_only=read_only, processes=processes, evictor=evictor
    )
    keyring = Keyring(config.encryption_key) if config.encryption_key is not None else None
    journal = open_journal(root, index, processes, keyring, disk.files)
    tiered = TieredStore(
        layout,
        config,
        memory_tiers=memory,
        disk=disk,
        remote=remote,
        encrypted=config.encryption_key is not None,
        stats=stats,
        counters=counters,
    )
    catalog = SessionCatalog(
        index.sessions,
        Leases(index.leases, processes) if processes is not None else None,
        journal,
        model_fingerprint=model_fingerprint,
        remote=tiered.remote,
        counters=counters,
        age_out=tiered.reencoder.age_out,
        supersede=tiered.reencoder.supersede,
        recent_blocks=config.ladder.recent_blocks,
        location=str(root),
    )
    found = catalog.find
    documents = SessionDocuments(
        index.documents,
        keyring,
        lambda namespace, session_id: found(namespace, session_id, strict=True) is not None,
        read_only=read_only,
    )
    keys_from = functools.partial(root_key, model_fingerprint, layout)
    io = SessionIO(
        layout,
        config,
        catalog,
        tiered.reads,
        tiered.writes,
        tiered.pool,
        stats=stats,
        counters=counters,
        reencoder=tiered.reencoder,
        forget=disk.cache.forget,
        root_key=keys_from,
        remote=tiered.remote,
    )
    blocks = BlockAccess(
        layout,
        config.ladder,
        tiered.reads,
        tiered.writes,
        stats=stats,
        memory=tiered.memory,
        demoter=tiered.demoter,
        tiers=tiered.tiers,
        rows=index.blocks,
        remote=tiered.remote is not None,
        read_only=read_only,
    )
    statistics = StoreStatistics(
        root,
        layout,
        tiered.tiers,
        counters,
        index,
        index.sessions,
        lost=disk.records.lost,
        outage=tiered.writes.outage,
        owns_memory=bool(tiered.memory.tiers),
    )
    maintenance = Maintenance(
        root,
        layout,
        config.ladder,
        catalog,
        documents,
        disk,
        tiered.disk_writer,
        index,
        processes=processes,
        flush=tiered.flush,
        guard=functools.partial(gc_guard, root, index, keyring),
        merge_journal=functools.partial(merge_journal, root, layout, journal.store_id, keyring)
        if processes is not None
        else None,
    )
    archives = Archives(
        layout,
        catalog,
        disk,
        tiered.disk_writer,
        documents,
        checkpoint=io.checkpoint,
        root_key=keys_from,
        encryption_key=config.encryption_key,
    )
    return StoreParts(
        tiered, disk, catalog, io, blocks, documents, statistics, maintenance, archives, journal
    )
