"""What the store does with device memory holding each class in its codec, beside placing blocks:
restores that keep its pages encoded, grades inside a session, upgrades on urgency. Built by the
:class:`~.tiered.TieredStore` with the parts each operation uses."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.index.session_grades import pack_grades, unpack_grades
from kvstrata.store.placement.device_pages import DevicePages
from kvstrata.store.placement.encodings import Encodings
from kvstrata.store.placement.reencoder import ReEncoder
from kvstrata.store.placement.upgrades import make_exact
from kvstrata.store.restore.paged import PagedRestore, RestoreInto, restore_paged
from kvstrata.store.tiers.base import Tier


class DevicePool:
    def __init__(
        self,
        device_pages: DevicePages | None,
        codecs: Callable[[BlockKey], list[int]],
        encodings: Encodings,
        reencoder: ReEncoder,
        disk: Tier,
        layout: KVLayout,
        put: Callable[..., bool],
        restore: RestoreInto,
    ) -> None:
        """``device_pages``: device memory's pages (None: no device tier holds pages);
        ``codecs``: the codecs the memory tiers hold a block in; ``put``: the placement's
        ``Writes.put``; ``restore``: its ``Reads.restore`` (the usual restore)."""
        self._device_pages = device_pages
        self._codecs = codecs
        self._encodings = encodings
        self._reencoder = reencoder
        self._disk = disk
        self._layout = layout
        self._put = put
        self._restore = restore

    def restore_paged(
        self,
        keys: Sequence[BlockKey],
        want: int,
        *,
        full: int,
        room: int,
        prefill: int,
        priority: Priority | None,
        max_loss: int | None,
        device: torch.device,
        out: torch.Tensor | None = None,
    ) -> PagedRestore | None:
        """A restore keeping device memory's pages encoded (:mod:`kvstrata.store.restore.paged`);
        None when it holds none of the blocks so. The caller holds ``keys``."""
        pages = self._device_pages
        if pages is None:
            return None
        return restore_paged(
            pages, self._restore, keys, want, full=full, room=room, prefill=prefill, layout=self._layout,
            priority=priority, max_loss=max_loss, on=device, out=out,
        )  # fmt: skip

    def upgrade(self, keys: Sequence[BlockKey], priority: Priority) -> tuple[int, int]:
        """Blocks held lossier than ``priority`` accepts made exact from L3's exact copies
        (:mod:`.upgrades`): (blocks made exact, blocks left lossy)."""
        put: Callable[[KVBlock], object] = functools.partial(self._put, priority=priority, replace=True)
        return make_exact(keys, self._encodings.max_loss(priority), self._codecs, self._disk, put)

    def regrade(self, keys: Sequence[BlockKey], recent_from: int) -> None:
        """Grade a session's blocks (:meth:`Encodings.regrade`); those whose grade changed out of
        the recent window are re-encoded in device memory in the background."""
        self._reencoder.compress(self._encodings.regrade(keys, recent_from))

    def grades(self, keys: Sequence[BlockKey]) -> bytes:
        """What a graded session's index row keeps of its full blocks' (``keys``) grades."""
        return pack_grades(self._encodings.grades_of(keys))

    def recall(self, keys: Sequence[BlockKey], stored: bytes, where: str) -> None:
        """Give a graded session's full blocks (``keys``) the grades its row kept (``grades``)
        where this process knows none: a restart or another process restores it at its grades.
        Grades of another count of blocks than ``keys`` (a row older than a truncate) are
        ignored."""
        grades = unpack_grades(stored, where)
        if len(grades) == len(keys):
            self._encodings.recall(keys, grades)

    def settle(self, keys: Sequence[BlockKey]) -> None:
        """Bring ``keys``' copies in device memory to what their class and grade hold them in
        (blocks a restore promoted as they came from below), in the background."""
        self._reencoder.compress(keys)
