"""The codec ladder: which codec each priority class gets in each tier.

A realtime agent keeps exact KV everywhere; an interactive one is quantized to int8 once it
leaves device memory; a background one to KIVI 4-bit; sessions idle for days are re-encoded to
KIVI 2-bit when ``gc`` moves them to ``cold/``. L1 always holds decoded tensors (a lossy block
decoded into device memory costs the same bytes as an exact one, so the ladder starts at L2).

A session's most recent ``recent_blocks`` full blocks and its tail stay exact (the KIVI
full-precision window): they are written exact and re-encoded off the request path once newer
blocks push them out of the window.

Blocks are shared between sessions, so a block is never stored lossier than the most demanding
session that uses it allows: ``max_loss_rank`` says what a priority class accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.codecs import CodecId, get_codec
from kvstrata.errors import ConfigError
from kvstrata.priority import Priority
from kvstrata.store.tiers.base import TierLevel

# How much a codec loses: 0 exact, higher is lossier. Decides which stored blocks a session may use.
LOSS_RANK: dict[CodecId, int] = {
    CodecId.IDENTITY: 0,
    CodecId.LOSSLESS: 0,
    CodecId.DELTA: 0,
    CodecId.FP16: 1,
    CodecId.BF16: 1,
    CodecId.INT8: 2,
    CodecId.KIVI4: 3,
    CodecId.KIVI2: 4,
    CodecId.SPARSE: 5,
    CodecId.NAIVE_INT4: 5,
}


def loss_rank(codec: CodecId | int | str) -> int:
    codec_id = get_codec(codec).codec_id if isinstance(codec, str) else CodecId(codec)
    return LOSS_RANK[codec_id]


@dataclass(frozen=True, slots=True)
class Rung:
    l2: str = "identity"
    l3: str = "identity"


@dataclass(frozen=True, slots=True)
class CodecLadder:
    realtime: Rung = field(default_factory=Rung)
    interactive: Rung = field(default_factory=lambda: Rung("int8", "int8"))
    background: Rung = field(default_factory=lambda: Rung("kivi4", "kivi4"))
    archived: str = "kivi2"
    recent_blocks: int = 1

    def __post_init__(self) -> None:
        for rung in (self.realtime, self.interactive, self.background):
            get_codec(rung.l2)
            get_codec(rung.l3)
        get_codec(self.archived)
        if self.recent_blocks < 0:
            raise ConfigError("recent_blocks must be >= 0")

    @classmethod
    def exact(cls) -> CodecLadder:
        """Identity everywhere: bit-exact resumes for every class."""
        return cls(Rung(), Rung(), Rung(), "identity", 0)

    def rung(self, priority: Priority) -> Rung:
        return {
            Priority.REALTIME: self.realtime,
            Priority.INTERACTIVE: self.interactive,
            Priority.BACKGROUND: self.background,
        }[priority]

    def codec_for(self, priority: Priority, level: TierLevel) -> str:
        rung = self.rung(priority)
        if level is TierLevel.L1:
            return "identity"
        return rung.l2 if level is TierLevel.L2 else rung.l3

    def max_loss_rank(self, priority: Priority) -> int:
        """The lossiest stored block a session of this class may attend to: what its own ladder
        produces, the archive codec included for the classes that get archived."""
        rung = self.rung(priority)
        archive = self.archive_codec(priority, pinned=False)
        return max(loss_rank(rung.l2), loss_rank(rung.l3), loss_rank(archive) if archive else 0)

    def archive_codec(self, priority: Priority, pinned: bool) -> str | None:
        """Codec for blocks of an idle session moved to ``cold/``; None keeps them as they are."""
        if pinned or priority is Priority.REALTIME:
            return None
        return self.archived
