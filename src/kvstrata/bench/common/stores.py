"""Stores the suites measure, built and read through kvstrata's public API only (``KVStore``,
``StoreConfig``), so that a suite measures whatever the store does today.

- :func:`workdir`: a suite's directory (a temp dir removed afterwards, or the user's, kept);
- :func:`cold_copy`: a store copied, as a restarted process over a cold disk sees it;
- :func:`bench_config`: a ``StoreConfig`` with fixed tier budgets and no idle demotion (a slow
  step between two measurements must not move the blocks);
- :func:`commit_session`: one session's KV appended and checkpointed into a store (timed);
- :class:`Restorer`: a resumed request's restore, timed, into a recycled buffer (as the engine);
- :func:`tier_bytes`, :func:`tier_hits`: what each tier holds and served.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvstrata.config import StoreConfig
    from kvstrata.integrations.transformers.model import LoadedModel
    from kvstrata.layout import KVLayout
    from kvstrata.store import KVStore, LoadedKV

SESSION_ID = "resumed"


@contextlib.contextmanager
def workdir(path: Path | None, prefix: str) -> Iterator[Path]:
    """``path`` (created, kept), or a temporary directory removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cold_copy(template: Path, root: Path) -> Path:
    """A copy of the store ``template`` at ``root``, its data files dropped from the page cache:
    a restarted process over a cold disk (memory tiers empty, L3 read from the device)."""
    from kvstrata.bench.common.hardware import drop_store_page_cache

    shutil.copytree(template, root)
    drop_store_page_cache(root)
    return root


def room_for(nbytes: int) -> int:
    """A memory tier budget that holds ``nbytes`` well below the high watermark (0.85), so that
    nothing is demoted while a suite measures."""
    return int(nbytes / 0.5) + (16 << 20)


def bench_config(l1: int = 0, l2: int = 0, *, ladder: str = "exact", **options: Any) -> StoreConfig:
    """A ``StoreConfig`` with these L1/L2 budgets, the ``exact`` or ``default`` codec ladder, and
    no idle demotion; ``options`` are further ``StoreConfig`` fields."""
    from kvstrata.config import StoreConfig
    from kvstrata.policy.ladder import CodecLadder

    if ladder not in ("exact", "default"):
        raise ConfigError(f"ladder must be exact or default, got {ladder!r}")
    options.setdefault("l1_idle_demote_s", None)
    options.setdefault("l2_idle_demote_s", None)
    return StoreConfig(
        l1_budget_bytes=l1,
        l2_budget_bytes=l2,
        ladder=CodecLadder.exact() if ladder == "exact" else CodecLadder(),
        **options,
    )


def open_store(
    loaded: LoadedModel | None,
    root: Path,
    config: StoreConfig,
    *,
    layout: KVLayout | None = None,
    read_only: bool = False,
) -> KVStore:
    """The store at ``root`` for ``loaded``'s layout and weights (or a bare ``layout``)."""
    from kvstrata.store import KVStore

    if loaded is not None:
        return KVStore(
            root,
            layout or loaded.layout(),
            model_fingerprint=loaded.fingerprint,
            config=config,
            read_only=read_only,
        )
    return KVStore(root, layout, model_fingerprint=b"bench", config=config, read_only=read_only)


@dataclass(frozen=True, slots=True)
class Committed:
    checkpoint_s: float
    """append + checkpoint: the session's blocks durable in L3 and its index row committed."""
    flush_s: float
    """The background work left afterwards (re-encodes of aged-out blocks down the ladder)."""


def commit_session(
    store: KVStore,
    token_ids: Sequence[int],
    kv: torch.Tensor,
    *,
    session_id: str = SESSION_ID,
    namespace: str = "default",
    priority: str = "realtime",
) -> Committed:
    """Append a whole session (its KV ``(2, L, H, n, D)``) and checkpoint it, then flush the
    store's background work; each timed."""
    session = store.create_session(session_id, namespace, priority=priority)
    started = time.perf_counter()
    store.append(session, token_ids, kv)
    store.checkpoint(session)
    checkpointed = time.perf_counter()
    store.flush()
    return Committed(checkpointed - started, time.perf_counter() - checkpointed)


@dataclass
class Restored:
    """One timed restore: ``load_s`` is ``store.load`` alone; ``restore_s`` adds building the
    ``KVStrataCache`` (what the engine does before its forward)."""

    load_s: float
    restore_s: float
    loaded: LoadedKV
    cache: Any = None


@dataclass
class Restorer:
    """Restores a session as the engine does: look it up, ``store.load`` into the previous
    request's buffer (already paged in: a restore into fresh memory spends most of its time in
    page faults), adopt the buffer as a ``KVStrataCache`` with room for ``extra_tokens``."""

    store: KVStore
    devices: list[Any] | None = None
    extra_tokens: int = 1
    session_id: str = SESSION_ID
    namespace: str = "default"
    spare: list[Any] = field(default_factory=list)
    """Buffers of finished restores (restorers of one session may share the list)."""

    def restore(self, *, build_cache: bool = True) -> Restored:
        from kvstrata.integrations.transformers.cache import KVStrataCache

        started = time.perf_counter()
        session = self.store.session(self.session_id, self.namespace)
        loaded = self.store.load(
            session,
            capacity=session.num_tokens + self.extra_tokens,
            out=self.spare.pop() if self.spare else None,
        )
        loaded_at = time.perf_counter()
        if loaded.kv is None or loaded.missing_from_token is not None:
            raise ConfigError(
                f"the store lost part of session {self.session_id} (got {loaded.num_tokens} of "
                f"{session.num_tokens} tokens)"
            )
        cache = None
        if build_cache:
            devices = self.devices or [None] * self.store.layout.num_layers  # None: the buffer's device
            cache = KVStrataCache.from_loaded(loaded, devices=devices, extra_tokens=self.extra_tokens)
        built_at = time.perf_counter()
        return Restored(loaded_at - started, built_at - started, loaded, cache)

    def recycle(self, restored: Restored) -> None:
        """Hand the restore's buffer to the next restore (once the caller is done with it)."""
        if restored.loaded.buffer is not None:
            self.spare.append(restored.loaded.buffer)
        restored.cache = None


def tier_bytes(store: KVStore) -> dict[str, int]:
    """Bytes the store's tiers hold now: L1 and L2 used bytes (memory), L3 stored bytes (disk)."""
    usage = {level.name: u for level, u in store.blocks.tier_usage().items()}
    return {"L1": usage["L1"].used_bytes, "L2": usage["L2"].used_bytes, "L3": usage["L3"].stored_bytes}


def tier_hits(store: KVStore) -> dict[str, int]:
    """Block hits per local tier since the store was opened in this process."""
    from kvstrata.store.tiers.base import TierLevel

    counters = store.counters.tiers
    return {level.name: counters[level].hits for level in (TierLevel.L1, TierLevel.L2, TierLevel.L3)}
