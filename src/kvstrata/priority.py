"""Priority classes of agents, and the one ranking of them every part of kvstrata uses.

A session's class decides how its blocks are encoded down the tiers (the codec ladder), how long
they stay in fast memory, and in which order requests are admitted and scheduled.
"""

from __future__ import annotations

import enum

from kvstrata.errors import ConfigError


class Priority(enum.StrEnum):
    REALTIME = "realtime"
    INTERACTIVE = "interactive"
    BACKGROUND = "background"

    @classmethod
    def parse(cls, value: str | Priority) -> Priority:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(
                f"unknown priority class {value!r}; use one of {', '.join(p.value for p in cls)}"
            ) from None

    @property
    def rank(self) -> int:
        """0 for the most demanding class (realtime), growing towards background: sort by it to
        serve (or keep) the most demanding first."""
        return _RANK[self]


_RANK = {Priority.REALTIME: 0, Priority.INTERACTIVE: 1, Priority.BACKGROUND: 2}


def higher_priority(a: Priority, b: Priority) -> Priority:
    """The more demanding of two classes."""
    return a if a.rank <= b.rank else b
