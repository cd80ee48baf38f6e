"""Which codec a block is kept in, tier by tier: the codec ladder applied to one block.

A block in a session's recent window stays exact; otherwise its class (the most demanding that
used it, :mod:`kvstrata.store.block_stats`) picks its rung of the ladder. A block already encoded
at least as lossily as the target is kept as it is: re-encoding cannot regain precision.

Where the class's L1 rung is graded, a block's copies below device memory are never lossier than
its grade's L1 codec (the first block, the attention sinks, exact): a restore from L3 then puts
each block back at its grade, which the session's index row keeps (:meth:`Encodings.grades_of`,
:meth:`Encodings.recall`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata import codecs
from kvstrata.codecs import Codec, Kivi2Codec, Kivi4Codec, KvmixCodec, loss_rank
from kvstrata.codecs.pages import can_page
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy.grades import grade_blocks
from kvstrata.policy.ladder import CodecLadder
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.index.session_grades import BlockGrade
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
            return self.codec(name)
        priority = stats.priority or Priority.INTERACTIVE
        codec = self.codec(self.ladder.codec_for(priority, level))
        if level is not TierLevel.L1 and self.ladder.graded(priority):
            # never lossier than its grade holds it in device memory (the sinks' block exact)
            floor = self.ladder.l1_codec(priority, stats.grade) if stats.start_pos != 0 else "identity"
            if self.codec(floor).loss_rank < codec.loss_rank:
                codec = self.codec(floor)
        return codec

    def regrade(self, keys: Sequence[BlockKey], recent_from: int) -> list[BlockKey]:
        """Grade a session's blocks (``keys`` in order; from ``recent_from`` on in its recent
        window) by importance, the system prompt's top (``policy/grades.py``); the keys out of
        the window whose grade changed."""
        shares = self.ladder.grades
        stats = self._stats
        grades = grade_blocks(
            [stats.importance(k) for k in keys],
            recent_from=recent_from,
            top_share=shares.top_share,
            bottom_share=shares.bottom_share,
            protected=[i for i, k in enumerate(keys) if stats.protected(k)],
        )
        changed = set(stats.set_grades(zip(keys, (g.value for g in grades), strict=True)))
        return [key for key in keys[:recent_from] if key in changed]

    def grades_of(self, keys: Sequence[BlockKey]) -> list[BlockGrade]:
        """What a session's index row keeps of its blocks' grades (``keys``: its full blocks)."""
        out = []
        for key in keys:
            stats = self._stats.get(key)
            if stats is None:
                out.append(BlockGrade(None, 0.0, False))
            else:
                out.append(BlockGrade(stats.grade, stats.importance, stats.protected))
        return out

    def recall(self, keys: Sequence[BlockKey], grades: Sequence[BlockGrade]) -> None:
        """Give ``keys`` (a session's full blocks) the grades its index row kept, where this
        process knows none yet (a restart, another process): what it knows is newer."""
        stats = self._stats
        table = stats.ensure_many(keys)
        stats.set_grades((k, g.grade) for k, s, g in zip(keys, table, grades, strict=True) if s.grade is None)
        stats.add_importance(
            (k, g.importance) for k, s, g in zip(keys, table, grades, strict=True) if s.importance == 0.0
        )
        stats.protect(k for k, g in zip(keys, grades, strict=True) if g.protected)

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

    def for_memory(self, block: KVBlock) -> KVBlock:
        """:meth:`fit` for L1 (device memory), where a lossy class's blocks are held as pages;
        a block the ladder keeps exact there is handed on as it is."""
        codec = self.l1_codec(block.key, block.start_pos)
        if codec.loss_rank == 0:
            return block
        if block.encoded is not None and loss_rank(block.encoded.codec) >= codec.loss_rank:
            return block
        return block.reencoded(codec, self.layout)

    def l1_codec(self, key: BlockKey, start_pos: int) -> Codec:
        """The codec device memory holds ``key`` in: its class's L1 codec (by its grade where the
        rung is graded: the first block, holding the attention sinks, then stays exact), but
        int8s for a block holding the sequence's first tokens where that codec is KIVI or kvmix (its
        verbatim sinks are no pages attention reads; a request's cache keeps them exact)."""
        stats = self._stats.get(key)
        if stats is None or stats.recent:
            return self.codec("identity")
        priority = stats.priority or Priority.INTERACTIVE
        if self.ladder.graded(priority) and start_pos == 0:
            return self.codec("identity")
        codec = self.codec(self.ladder.l1_codec(priority, stats.grade))
        if isinstance(codec, Kivi4Codec | Kivi2Codec | KvmixCodec) and start_pos < codec.sink_tokens:
            codec = self.codec("int8s")
        if codec.loss_rank > 0 and not can_page(codec.codec_id, self.layout.head_dim):
            # no pages of this head dim for attention to read: held decoded it would save nothing
            # and only lose precision, so device memory keeps the block exact
            return self.codec("identity")
        return codec

    def compressible(self, key: BlockKey, held_codec: int) -> Codec | None:
        """The codec an L1 block held in ``held_codec`` should be re-encoded to (its class's L1
        codec, out of the recent window), or None when it is held as precisely as it should be."""
        stats = self._stats.get(key)
        codec = self.l1_codec(key, stats.start_pos if stats is not None else 0)
        if codec.loss_rank == 0 or loss_rank(held_codec) >= codec.loss_rank:
            return None
        return codec

    def for_disk(self, block: KVBlock) -> KVBlock:
        """:meth:`fit` for L3 (what the writer is handed)."""
        return self.fit(block, TierLevel.L3)
