"""A session's checkpoint: its blocks made durable in L3, then its index row committed (in that
order, so a committed session never names a block that is not on disk), then published through
the remote tier. Part of :class:`~kvstrata.store.session_io.SessionIO` (``checkpoint``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.errors import TierUnavailableError
from kvstrata.keys import BlockKey
from kvstrata.store.catalog import SessionCatalog
from kvstrata.store.placement.writes import Writes
from kvstrata.store.remote_mirror import RemoteMirror
from kvstrata.store.sessions import Session

_CHECKPOINT_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Checkpoints:
    catalog: SessionCatalog
    writes: Writes
    forget: Callable[[BlockKey], None]
    """The disk tier's placement cache's (a block another process removed)."""
    remote: RemoteMirror | None

    def write(self, session: Session) -> None:
        """Make ``session``'s blocks durable, commit its row, publish it; raises when L3 cannot."""
        keys = session.all_keys()
        for _ in range(_CHECKPOINT_ATTEMPTS):
            missing = self.writes.make_durable(keys)
            if missing:
                raise TierUnavailableError(
                    f"checkpoint of {session.namespace}/{session.id} failed: {len(missing)} blocks could not "
                    f"be written to L3 ({self.writes.outage(missing) or 'not found in any tier'}); the "
                    "previous checkpoint stays valid"
                )
            session.version += 1
            # the commit checks, in its transaction, that every block still has its row: another
            # process's gc or eviction may have removed one since it was written
            gone = self.catalog.commit(session, required=keys)
            if not gone:
                break
            session.version -= 1
            for key in gone:
                self.forget(BlockKey(key))  # written again from memory next round
        else:
            raise TierUnavailableError(
                f"checkpoint of {session.namespace}/{session.id} failed: its blocks kept being removed by "
                "another process (gc or eviction); the previous checkpoint stays valid"
            )
        session.checkpointed_tokens = session.num_tokens
        self.catalog.unpin(session)  # its row names its blocks now
        self._publish(session)

    def _publish(self, session: Session) -> None:
        """Share the checkpoint through the remote tier: blocks first, then the manifest by
        compare-and-set. A remote outage only skips this; a conflict raises (the local
        checkpoint above is kept, so nothing is lost: fork it to keep both histories)."""
        remote = self.remote
        if remote is None or not self.writes.publish_remote(session.all_keys()):
            return
        version = remote.publish_manifest(
            session.namespace, session.id, session.to_manifest(), session.remote_version
        )
        if version is None:
            return
        session.remote_version = version
        self.catalog.commit(session)
