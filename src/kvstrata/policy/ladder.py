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

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstrata.errors import ConfigError
from kvstrata.priority import Priority
from kvstrata.tiering import TierLevel

# The codecs are imported where they are used: they load torch, and the store's configuration
# (which holds a ladder) must import without it.


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
        from kvstrata.codecs import get_codec

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
                rungs[priority.value] = Rung(spec, spec)
            elif isinstance(spec, Mapping) and set(spec) <= {"l2", "l3"}:
                rungs[priority.value] = Rung(spec.get("l2", default.l2), spec.get("l3", default.l3))
            else:
                raise ConfigError(
                    f"{where}.{priority.value} must be a codec name or {{'l2': .., 'l3': ..}}, got {spec!r}"
                )
        recent = value.get("recent_blocks", base.recent_blocks)
        if not isinstance(recent, int) or isinstance(recent, bool):
            raise ConfigError(f"{where}.recent_blocks must be an integer, got {recent!r}")
        archived = value.get("archived", base.archived)
        if not isinstance(archived, str):
            raise ConfigError(f"{where}.archived must be a codec name, got {archived!r}")
        return cls(rungs["realtime"], rungs["interactive"], rungs["background"], archived, recent)

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
        from kvstrata.codecs import loss_rank

        rung = self.rung(priority)
        archive = self.archive_codec(priority, pinned=False)
        return max(loss_rank(rung.l2), loss_rank(rung.l3), loss_rank(archive) if archive else 0)

    def archive_codec(self, priority: Priority, pinned: bool) -> str | None:
        """Codec for blocks of an idle session moved to ``cold/``; None keeps them as they are."""
        if pinned or priority is Priority.REALTIME:
            return None
        return self.archived
