"""The remote tier (L4, Redis) as a mirror of the local store, shared by engines on many machines.

Blocks follow L3 to Redis behind the local write (or with it, in write-through mode), so another
engine with an empty disk can read them; a checkpoint publishes the session's manifest by
compare-and-set once every block it names is there. Reads come through here when no local tier
holds a block: one at a time on the lookup path, or a whole prefix in one pipelined round trip
(``fetch_many``). Every failure (a down or hung Redis, a damaged value) is counted and turned into
a miss: the remote tier never fails a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvstrata.codecs import loss_rank
from kvstrata.errors import TierUnavailableError
from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock
from kvstrata.store.counters import VERIFY_ERRORS, StoreCounters
from kvstrata.store.tiers.base import TierLevel
from kvstrata.store.tiers.remote import RedisTier
from kvstrata.store.writer import BackgroundWriter

log = logging.getLogger(__name__)


class RemoteMirror:
    def __init__(
        self,
        tier: RedisTier,
        counters: StoreCounters,
        *,
        seal: Callable[[KVBlock], KVBlock],
        max_queue_bytes: int,
    ) -> None:
        self.tier = tier
        self.counters = counters
        self.write_through = tier.config.write_through
        self._seal = seal
        self._writer = BackgroundWriter(
            self._write,
            max_queue_bytes=max_queue_bytes,
            on_failure=self._on_failure,
            name="kvstrata-remote-writer",
        )

    # -- writes ----------------------------------------------------------------------------------
    def submit(self, block: KVBlock) -> None:
        """Queue ``block`` for Redis, off the request path."""
        self._writer.submit(block)

    def _write(self, block: KVBlock) -> bool:
        started = time.perf_counter()
        stored = self.tier.put(self._seal(block))
        if stored:
            self.counters.saved(TierLevel.L4, time.perf_counter() - started)
        return stored

    def _on_failure(self, block: KVBlock, error: Exception) -> None:
        self.counters.remote_errors += 1

    def publish(self, keys: Sequence[BlockKey], local_copy: Callable[[BlockKey], KVBlock | None]) -> bool:
        """Make sure L4 holds every block of ``keys`` (pipelined), so another engine can load a
        session whose manifest names them; False when the remote tier is unavailable."""
        self._writer.flush(keys)
        try:
            present = self.tier.contains_many(keys)
            missing = [k for k, here in zip(keys, present, strict=True) if not here]
            blocks = [self._seal(b) for k in missing if (b := local_copy(k)) is not None]
            if len(blocks) < len(missing):
                return False
            if blocks:
                self.tier.put_many(blocks)
        except TierUnavailableError as exc:
            self.counters.remote_errors += 1
            log.warning("remote tier unavailable, session not published: %s", exc)
            return False
        return True

    # -- reads -----------------------------------------------------------------------------------
    def get(self, key: BlockKey, max_loss: int | None) -> KVBlock | None:
        """``key`` from Redis, verified; None on a miss, an outage, damage or a copy lossier than
        ``max_loss`` allows."""
        try:
            block = self.tier.get(key)
        except TierUnavailableError as exc:
            self.counters.remote_errors += 1
            log.debug("remote tier skipped: %s", exc)
            return None
        except VERIFY_ERRORS as exc:
            self.counters.unreadable(exc, "remote", log)
            return None
        if (
            block is not None
            and max_loss is not None
            and block.encoded is not None
            and loss_rank(block.encoded.codec) > max_loss
        ):
            self.counters.rejected_lossy += 1
            return None
        return block

    def fetch_many(self, keys: Sequence[BlockKey]) -> list[KVBlock]:
        """The blocks of ``keys`` Redis holds, in one pipelined round trip ([] on an outage)."""
        try:
            fetched = self.tier.get_many(keys)
        except TierUnavailableError as exc:
            self.counters.remote_errors += 1
            log.debug("remote prefetch skipped: %s", exc)
            return []
        return [b for b in fetched if b is not None]

    # -- session manifests -----------------------------------------------------------------------
    def fetch_manifest(self, namespace: str, session_id: str) -> tuple[int, bytes] | None:
        """The session's manifest and version, None if Redis holds none; ``TierUnavailableError``
        (counted) when Redis does not answer: the caller tells "unavailable" from "missing"."""
        try:
            return self.tier.fetch_manifest(namespace, session_id)
        except TierUnavailableError as exc:
            self.counters.remote_errors += 1
            log.warning("remote manifest of %s/%s not read: %s", namespace, session_id, exc)
            raise

    def publish_manifest(
        self, namespace: str, session_id: str, data: bytes, expected_version: int
    ) -> int | None:
        """The new manifest version, or None when the remote tier is unavailable (a conflict, a
        newer version published by another engine, raises ``SessionConflictError``)."""
        try:
            return self.tier.publish_manifest(namespace, session_id, data, expected_version)
        except TierUnavailableError as exc:
            self.counters.remote_errors += 1
            log.warning("session %s/%s not published to the remote tier: %s", namespace, session_id, exc)
            return None

    def delete_manifest(self, namespace: str, session_id: str) -> None:
        try:
            self.tier.delete_manifest(namespace, session_id)
        except TierUnavailableError as exc:
            log.warning("remote manifest of %s/%s not deleted: %s", namespace, session_id, exc)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close(flush=True)
        self.tier.close()
