"""The codec ladder: which codec each priority class gets in each tier.

A realtime agent keeps exact KV everywhere; an interactive one is held as int8s in device memory
(L1) and int8 below it; a background one as KIVI 4-bit; sessions idle for days are re-encoded
to KIVI 2-bit when ``gc`` moves them to ``cold/``. L1 holds a lossy class's blocks encoded, as
pages attention reads in place (``kvstrata.codecs.pages``: identity, int8s, kivi4, kivi2 and
kvmix can sit there; a ladder naming another codec for L1 is refused), so the same device memory
holds more agents of the lower classes.

A session's most recent ``recent_blocks`` full blocks and its tail stay exact (the KIVI
full-precision window): they are written exact and re-encoded off the request path once newer
blocks push them out of the window.

Blocks are shared between sessions, so a block is never stored lossier than the most demanding
session that uses it allows: ``max_loss_rank`` says what a priority class accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.errors import ConfigError
from kvstrata.policy.grades import Grade, GradedCodecs
from kvstrata.priority import Priority
from kvstrata.tiering import TierLevel

GRADED = "graded"
"""An L1 rung of this name holds the class's blocks by grade inside their session (``grades``)."""

if TYPE_CHECKING:
    from kvstrata.layout import KVLayout

# The codecs are imported where they are used: they load torch, and the store's configuration
# (which holds a ladder) must import without it.


@dataclass(frozen=True, slots=True)
class Rung:
    l2: str = "identity"
    l3: str = "identity"
    l1: str = "identity"
    """What device memory holds the class's blocks in (out of their session's recent window)."""


@dataclass(frozen=True, slots=True)
class CodecLadder:
    realtime: Rung = field(default_factory=Rung)
    interactive: Rung = field(default_factory=lambda: Rung("int8", "int8", "int8s"))
    background: Rung = field(default_factory=lambda: Rung("kivi4", "kivi4", "kivi4"))
    archived: str = "kivi2"
    recent_blocks: int = 1
    grades: GradedCodecs = field(default_factory=GradedCodecs)
    """The codecs by grade of a class whose L1 rung is ``graded``."""

    def __post_init__(self) -> None:
        from kvstrata.codecs import get_codec
        from kvstrata.codecs.pages import PAGE_CODECS

        for priority, rung in zip(Priority, (self.realtime, self.interactive, self.background), strict=True):
            get_codec(rung.l2)
            get_codec(rung.l3)
            graded = [self.grades.top, self.grades.middle, self.grades.bottom]
            for name in graded if rung.l1 == GRADED else [rung.l1]:
                l1 = get_codec(name or "identity")
                if l1.name != "identity" and l1.codec_id not in PAGE_CODECS:
                    held = ", ".join(["identity", *PAGE_CODECS.values(), GRADED])
                    raise ConfigError(
                        f"codec {name!r} cannot sit in L1 (device memory, the {priority.value} class): "
                        f"attention reads only {held} there"
                    )
        get_codec(self.archived)
        if self.recent_blocks < 0:
            raise ConfigError("recent_blocks must be >= 0")

    @classmethod
    def exact(cls) -> CodecLadder:
        """Identity everywhere: bit-exact resumes for every class."""
        return cls(Rung(), Rung(), Rung(), "identity", 0)

    @classmethod
    def parse(cls, value: object, where: str = "ladder") -> CodecLadder:
        """``"default"``, ``"exact"``, or an object ``{"realtime": {"l2": .., "l3": ..},
        "interactive": .., "background": .., "archived": "kivi2", "recent_blocks": 1}`` (a class
        given one codec name uses it in both tiers; missing keys keep their defaults)."""
        if value is None or value == "default":
            return cls()
        if value == "exact":
            return cls.exact()
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be 'default', 'exact' or an object, got {value!r}")
        unknown = set(value) - {"realtime", "interactive", "background", "archived", "recent_blocks"}
        if unknown:
            raise ConfigError(f"unknown {where} keys: {', '.join(sorted(unknown))}")
        base = cls()
        rungs: dict[str, Rung] = {}
        for priority in Priority:
            spec, default = value.get(priority.value), base.rung(priority)
            if spec is None:
                rungs[priority.value] = default
            elif isinstance(spec, str):
                rungs[priority.value] = Rung(spec, spec, default.l1)
            elif isinstance(spec, Mapping) and set(spec) <= {"l1", "l2", "l3"}:
                rungs[priority.value] = Rung(
                    spec.get("l2", default.l2), spec.get("l3", default.l3), spec.get("l1", default.l1)
                )
            else:
                raise ConfigError(
                    f"{where}.{priority.value} must be a codec name or {{'l1': .., 'l2': .., 'l3': ..}}, "
                    f"got {spec!r}"
                )
        recent = value.get("recent_blocks", base.recent_blocks)
        if not isinstance(recent, int) or isinstance(recent, bool):
            raise ConfigError(f"{where}.recent_blocks must be an integer, got {recent!r}")
        archived = value.get("archived", base.archived)
        if not isinstance(archived, str):
            raise ConfigError(f"{where}.archived must be a codec name, got {archived!r}")
        return cls(rungs["realtime"], rungs["interactive"], rungs["background"], archived, recent)

    def for_layout(self, layout: KVLayout) -> CodecLadder:
        """The ladder a store of ``layout`` runs: this one, except for fp8 blocks (vLLM's fp8 KV
        caches), which are kept byte for byte: the default ladder becomes :meth:`exact` there, and
        a ladder naming a lossy codec for them is refused (it would quantize values already
        quantized, after a round trip through another dtype)."""
        if not layout.fp8:
            return self
        if self == CodecLadder():
            return CodecLadder.exact()
        from kvstrata.codecs import get_codec

        grades = [self.grades.top, self.grades.middle, self.grades.bottom]
        for priority in Priority:
            rung = self.rung(priority)
            l1 = grades if rung.l1 == GRADED else [rung.l1]
            named = [*(("L1", name or "identity") for name in l1), ("L2", rung.l2), ("L3", rung.l3)]
            if priority is not Priority.REALTIME:
                named.append(("cold/", self.archived))
            for tier, name in named:
                if not get_codec(name).lossless:
                    raise ConfigError(
                        f"codec {name!r} cannot store {layout.dtype} KV ({tier}, the {priority.value} "
                        "class): fp8 blocks are kept byte for byte; use identity, lossless or delta "
                        "(ladder 'exact')"
                    )
        return self

    def rung(self, priority: Priority) -> Rung:
        return {
            Priority.REALTIME: self.realtime,
            Priority.INTERACTIVE: self.interactive,
            Priority.BACKGROUND: self.background,
        }[priority]

    def codec_for(self, priority: Priority, level: TierLevel) -> str:
        rung = self.rung(priority)
        if level is TierLevel.L1:
            return self.l1_codec(priority, None)
        return rung.l2 if level is TierLevel.L2 else rung.l3

    def l1_codec(self, priority: Priority, grade: str | None) -> str:
        """What device memory holds a block of ``priority`` in, given its ``grade`` inside its
        session where the class's L1 rung is graded (no grade yet: the middle one)."""
        rung = self.rung(priority)
        if rung.l1 != GRADED:
            return rung.l1
        return self.grades.codec_for(Grade(grade or Grade.MIDDLE)) or "identity"

    def graded(self, priority: Priority) -> bool:
        return self.rung(priority).l1 == GRADED

    def max_loss_rank(self, priority: Priority) -> int:
        """The lossiest stored block a session of this class may attend to: what its own ladder
        produces, the archive codec included for the classes that get archived."""
        from kvstrata.codecs import loss_rank

        rung = self.rung(priority)
        archive = self.archive_codec(priority, pinned=False)
        l1 = [self.grades.top, self.grades.middle, self.grades.bottom] if rung.l1 == GRADED else [rung.l1]
        ranks = [*(loss_rank(c or "identity") for c in l1), loss_rank(rung.l2), loss_rank(rung.l3)]
        return max(*ranks, loss_rank(archive) if archive else 0)

    def archive_codec(self, priority: Priority, pinned: bool) -> str | None:
        """Codec for blocks of an idle session moved to ``cold/``; None keeps them as they are."""
        if pinned or priority is Priority.REALTIME:
            return None
        return self.archived
