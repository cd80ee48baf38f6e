"""Which codec a block is kept in, tier by tier: the codec ladder applied to one block.

A block in a session's recent window stays exact; otherwise its class (the most demanding that
used it, :mod:`kvstrata.store.block_stats`) picks its rung of the ladder. A block already encoded
at least as lossily as the target is kept as it is: re-encoding cannot regain precision.
"""

from __future__ import annotations

from kvstrata import codecs
from kvstrata.codecs import Codec, loss_rank
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy.ladder import CodecLadder
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.tiering import TierLevel


class Encodings:
    def __init__(self, layout: KVLayout, ladder: CodecLadder, stats: BlockStatsTable) -> None:
        self.layout = layout
        self.ladder = ladder
        self._stats = stats
        self._codecs: dict[str, Codec] = {}

    def codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = codecs.get_codec(name)
        return codec

    def target(self, key: BlockKey, level: TierLevel) -> Codec:
        """What the ladder wants for ``key`` in ``level``: exact while in a recent window."""
        stats = self._stats.get(key)
        if stats is None or stats.recent:
            name = "identity" if stats is not None else self.ladder.codec_for(Priority.INTERACTIVE, level)
        else:
            name = self.ladder.codec_for(stats.priority or Priority.INTERACTIVE, level)
        return self.codec(name)

    def max_loss(self, priority: Priority | None) -> int:
        """The lossiest stored copy a session of ``priority`` (interactive when unknown) accepts."""
        return self.ladder.max_loss_rank(priority or Priority.INTERACTIVE)

    def fit(self, block: KVBlock, level: TierLevel) -> KVBlock:
        """``block`` encoded as the ladder wants for ``level``; an encoding already at least as
        lossy is kept (re-encoding cannot regain precision, it would only cost time)."""
        codec = self.target(block.key, level)
        if block.encoded is not None and loss_rank(block.encoded.codec) >= codec.loss_rank:
            return block
        return block.reencoded(codec, self.layout)

    def for_disk(self, block: KVBlock) -> KVBlock:
        """:meth:`fit` for L3 (what the writer is handed)."""
        return self.fit(block, TierLevel.L3)
