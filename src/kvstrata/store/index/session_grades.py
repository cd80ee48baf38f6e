"""The grades of a session's blocks as its index row keeps them (the ``grades`` column, format 5).

A session whose class's L1 rung is graded (``policy/grades.py``) holds its blocks at different
precisions by their grade inside it; the grades, and the attention mass they were computed from,
are kept with the session's row so that a restart, or a restore from L3 in another process,
puts each block back at its grade (``store/session_io.py``).

Stored form (one BLOB, covered by the row's CRC32C): a format byte (1), then per full block, in
the order of ``block_keys``, 5 bytes: a code byte (bits 0-2 the grade: 0 none, 1 recent, 2 top,
3 middle, 4 bottom; bit 7: the block is part of a system prompt) and the attention mass the block
received, a little-endian float32. NULL: the session has no grades (its class is not graded, or
the row was written before format 5).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.errors import CorruptBlockError
from kvstrata.policy.grades import Grade

GRADES_FORMAT = 1
_ENTRY = struct.Struct("<Bf")
_CODES: dict[str | None, int] = {
    None: 0,
    Grade.RECENT.value: 1,
    Grade.TOP.value: 2,
    Grade.MIDDLE.value: 3,
    Grade.BOTTOM.value: 4,
}
_GRADES = {code: grade for grade, code in _CODES.items()}
_PROTECTED = 0x80


@dataclass(frozen=True, slots=True)
class BlockGrade:
    grade: str | None
    importance: float
    protected: bool


def pack_grades(blocks: Sequence[BlockGrade]) -> bytes:
    """The stored form of ``blocks``' grades (one per full block, in order)."""
    parts = [bytes((GRADES_FORMAT,))]
    for block in blocks:
        code = _CODES[block.grade] | (_PROTECTED if block.protected else 0)
        importance = block.importance if math.isfinite(block.importance) else 0.0
        parts.append(_ENTRY.pack(code, min(max(importance, 0.0), 3.0e38)))
    return b"".join(parts)


def unpack_grades(data: bytes, where: str) -> list[BlockGrade]:
    """The grades a stored ``grades`` value holds; a damaged one is a
    :class:`~kvstrata.errors.CorruptBlockError` naming ``where``."""
    if not data or data[0] != GRADES_FORMAT or (len(data) - 1) % _ENTRY.size:
        raise CorruptBlockError(f"{where}: its block grades are damaged (format or length)")
    out = []
    for code, importance in _ENTRY.iter_unpack(data[1:]):
        grade = _GRADES.get(code & ~_PROTECTED, "?")
        if grade == "?" or not math.isfinite(importance) or importance < 0:
            raise CorruptBlockError(f"{where}: its block grades are damaged (a code or a mass)")
        out.append(BlockGrade(grade, importance, bool(code & _PROTECTED)))
    return out
