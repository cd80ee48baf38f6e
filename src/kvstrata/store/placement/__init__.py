"""Placement: one block namespace over the tiers (:class:`~.tiered.TieredStore`), made of parts:
:mod:`.memory` (the memory tiers and the moves between them; the placement lock),
:mod:`.encodings` (the codec ladder per block), :mod:`.demoter` and :mod:`.reencoder` (the
background threads), with the disk writer (:mod:`kvstrata.store.durability`), the remote mirror
and the restorer (:mod:`kvstrata.store.restore`) beside them."""

from kvstrata.store.placement.tiered import TieredStore

__all__ = ["TieredStore"]
