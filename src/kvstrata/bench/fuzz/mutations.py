"""What the fuzzer does to a store's files: damage as disks, crashes, bugs and operators cause it.

Each mutation takes the store's root, a ``random.Random`` and the root of another store (for
files from elsewhere), changes something, and returns one line saying what it did (the trial's
record, so a failure can be replayed). Byte-level mutations hit segments, block files and index
pages; row-level ones open the index with SQLite and change one value of one row (a session row,
a block row, a document, the store's format record), the way a bug or a torn page could.
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

PAGE = 4096
Mutation = Callable[[Path, random.Random, Path], str]


DATA_DIRS = ("segments", "hot", "cold", "journal")
"""Where a store keeps files the index describes or is rebuilt from (``journal``: the sessions'
journal, where the store has one)."""


def data_files(root: Path) -> list[Path]:
    """Segments, block files (hot and cold) and journal files of a store."""
    found = [p for sub in DATA_DIRS for p in (root / sub).rglob("*") if p.is_file()]
    return sorted(found)


def _any_file(root: Path, rng: random.Random) -> Path:
    files = [*data_files(root), root / "index.sqlite"]
    return rng.choice(files)


def flip_bits(root: Path, rng: random.Random, other: Path) -> str:
    path = _any_file(root, rng)
    data = bytearray(path.read_bytes())
    if not data:
        return f"flip: {path.name} is empty"
    flips = [rng.randrange(len(data) * 8) for _ in range(rng.choice((1, 1, 1, 2, 8)))]
    for bit in flips:
        data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))
    return f"flip bits {flips[:3]} of {path.relative_to(root)}"


def zero_range(root: Path, rng: random.Random, other: Path) -> str:
    path = _any_file(root, rng)
    size = path.stat().st_size
    if not size:
        return f"zero: {path.name} is empty"
    start = rng.randrange(size)
    length = min(size - start, rng.choice((1, 16, 92, 512, PAGE)))
    with path.open("r+b") as f:
        f.seek(start)
        f.write(bytes(length))
    return f"zero {length} bytes at {start} of {path.relative_to(root)}"


def zero_index_page(root: Path, rng: random.Random, other: Path) -> str:
    path = root / "index.sqlite"
    pages = max(1, path.stat().st_size // PAGE)
    page = rng.randrange(pages)
    with path.open("r+b") as f:
        f.seek(page * PAGE)
        f.write(bytes(PAGE))
    return f"zero index page {page} of {pages}"


def copy_index_page(root: Path, rng: random.Random, other: Path) -> str:
    path = root / "index.sqlite"
    data = bytearray(path.read_bytes())
    pages = max(1, len(data) // PAGE)
    src, dst = rng.randrange(pages), rng.randrange(pages)
    data[dst * PAGE : (dst + 1) * PAGE] = data[src * PAGE : (src + 1) * PAGE]
    path.write_bytes(bytes(data))
    return f"index page {src} copied over page {dst}"


def truncate(root: Path, rng: random.Random, other: Path) -> str:
    path = _any_file(root, rng)
    size = path.stat().st_size
    keep = rng.randrange(size) if size else 0
    os.truncate(path, keep)
    return f"truncate {path.relative_to(root)} to {keep} of {size} bytes"


def extend(root: Path, rng: random.Random, other: Path) -> str:
    path = _any_file(root, rng)
    extra = rng.randbytes(rng.choice((1, 7, 92, PAGE)))
    with path.open("ab") as f:
        f.write(extra)
    return f"append {len(extra)} random bytes to {path.relative_to(root)}"


def remove_file(root: Path, rng: random.Random, other: Path) -> str:
    path = rng.choice(data_files(root) or [root / "index.sqlite"])
    path.unlink()
    return f"remove {path.relative_to(root)}"


def foreign_file(root: Path, rng: random.Random, other: Path) -> str:
    """A data file replaced by one of another store (same name, other bytes), or by another of
    this store's files: records of other blocks where the index expects these."""
    mine = data_files(root)
    if not mine:
        return "foreign: no data file"
    target = rng.choice(mine)
    theirs = data_files(other) if rng.random() < 0.5 else mine
    source = rng.choice(theirs or mine)
    shutil.copyfile(source, target)
    where = "another store" if theirs is not mine else "this one"
    return f"{target.relative_to(root)} replaced by {source.name} of {where}"


def foreign_index(root: Path, rng: random.Random, other: Path) -> str:
    """The index replaced by another store's (its blocks and sessions are not these files')."""
    shutil.copyfile(other / "index.sqlite", root / "index.sqlite")
    return "index.sqlite replaced by another store's"


def garbage_wal(root: Path, rng: random.Random, other: Path) -> str:
    """A WAL file left beside the index: random bytes, or a valid-looking header over garbage."""
    data = rng.randbytes(rng.choice((32, PAGE, 3 * PAGE)))
    if rng.random() < 0.5:
        data = bytes.fromhex("377f0682002de218") + data[8:]  # the WAL magic and format
    (root / "index.sqlite-wal").write_bytes(data)
    return f"garbage WAL of {len(data)} bytes"


# -- row-level damage ------------------------------------------------------------------------------


class BadText(bytes):
    """Bytes stored as TEXT without a check (``CAST(? AS TEXT)``): a text value that is not UTF-8,
    as a flipped bit in a row leaves it."""


def _bad_text(r: random.Random) -> BadText:
    return BadText(r.choice((b"\xff\xfe", b"rt-\xa0", b"\xc3")))


_ROW_DAMAGE: dict[str, list[tuple[str, Callable[[random.Random], object]]]] = {
    "sessions": [
        ("token_ids", lambda r: r.randbytes(r.choice((4, 40, 77)))),
        ("block_keys", lambda r: r.randbytes(32 * r.randrange(1, 4))),
        ("tail_key", lambda r: r.choice((None, r.randbytes(32), b"x"))),
        ("num_tokens", lambda r: r.choice((-1, 0, 10**12, "many", 3.5))),
        ("priority", lambda r: r.choice(("", "urgent", "\udcff", 7, None))),
        ("pinned", lambda r: r.choice((2, "yes", None))),
        ("ttl_s", lambda r: r.choice((float("nan"), -5.0, "soon", b"\x00"))),
        ("created", lambda r: r.choice((float("inf"), "yesterday", None))),
        ("model_fingerprint", lambda r: r.randbytes(8)),
        ("lineage", lambda r: r.choice((r.randbytes(16), b"short"))),
        ("row_crc", lambda r: r.choice((None, 0, "crc"))),
        ("sealed", lambda r: r.choice((0, 1, 2))),
        ("id", lambda r: r.choice(("renamed", "rt-a", _bad_text(r)))),
        ("namespace", lambda r: r.choice(("other", _bad_text(r)))),
    ],
    "blocks": [
        ("codec", lambda r: r.choice((99, -1, "int8", None))),
        ("nbytes", lambda r: r.choice((0, -3, 1 << 40, 17))),
        ("num_tokens", lambda r: r.choice((0, 5, -1, "four"))),
        ("start_pos", lambda r: r.choice((-4, 1 << 40, "zero"))),
        ("seg_offset", lambda r: r.choice((None, -1, 17, 1 << 40, "far"))),
        ("file_id", lambda r: r.choice(("", "0" * 16, "../../etc", "nope", "ab\x00cd", _bad_text(r)))),
        ("namespace", lambda r: r.choice(("other", None, 5, _bad_text(r)))),
        ("cold", lambda r: r.choice((0, 1, 7))),
        ("key", lambda r: r.randbytes(32)),
    ],
    "session_documents": [
        ("data", lambda r: r.randbytes(12)),
        ("crc", lambda r: r.choice((0, None, "x"))),
        ("sealed", lambda r: r.choice((0, 1, 5))),
        ("name", lambda r: r.choice(("other", _bad_text(r)))),
    ],
    "block_usage": [
        ("blocks", lambda r: r.choice((-1, 1 << 40, "many", None))),
        ("bytes", lambda r: r.choice((-1, 1 << 62, "lots", 2.5))),
        ("namespace", lambda r: r.choice(("other", _bad_text(r)))),
    ],
    "meta": [
        ("value", lambda r: r.choice(("", "{", "99", "-1", '{"num_layers": 2}', _bad_text(r)))),
    ],
}


def damage_row(root: Path, rng: random.Random, other: Path) -> str:
    """One value of one row set to something else (a wrong value, a wrong type, NULL)."""
    table = rng.choice(sorted(_ROW_DAMAGE))
    column, value_of = rng.choice(_ROW_DAMAGE[table])
    value = value_of(rng)
    try:
        with sqlite3.connect(root / "index.sqlite") as db:
            rows = db.execute(f"SELECT rowid FROM {table}").fetchall() if table == "meta" else []
            keys = _row_keys(db, table)
            if not keys and not rows:
                return f"no rows in {table}"
            where, args = rng.choice(keys)
            if isinstance(value, BadText):
                mark, value = "CAST(? AS TEXT)", bytes(value)
            else:
                mark = "?"
            db.execute(f"UPDATE OR IGNORE {table} SET {column} = {mark} WHERE {where}", (value, *args))
    except sqlite3.Error as exc:  # the damage itself could not be made (a constraint): none made
        return f"row damage of {table}.{column} not made: {exc}"
    return f"{table}.{column} of one row set to {value!r:.40}"


def _row_keys(db: sqlite3.Connection, table: str) -> list[tuple[str, tuple[object, ...]]]:
    if table == "sessions":
        return [
            ("namespace = ? AND id = ?", tuple(r)) for r in db.execute("SELECT namespace, id FROM sessions")
        ]
    if table == "blocks":
        return [("key = ?", (r[0],)) for r in db.execute("SELECT key FROM blocks")]
    if table == "session_documents":
        return [
            ("namespace = ? AND session_id = ? AND name = ?", tuple(r))
            for r in db.execute("SELECT namespace, session_id, name FROM session_documents")
        ]
    if table == "block_usage":
        return [("namespace = ?", (r[0],)) for r in db.execute("SELECT namespace FROM block_usage")]
    return [("name = ?", (r[0],)) for r in db.execute("SELECT name FROM meta")]


def forge_session_tokens(root: Path, rng: random.Random, other: Path) -> str:
    """Token ids changed and the row's checksum made to match (a bug that wrote a wrong row, or a
    checksum collision): only the check of token ids against block keys is left to catch it."""
    from kvstrata.store.index.session_codec import row_crc
    from kvstrata.store.index.session_rows import COLUMNS, TABLE

    with sqlite3.connect(root / "index.sqlite") as db:
        stored = db.execute(f"SELECT {', '.join(TABLE.names)} FROM sessions WHERE sealed = 0").fetchall()
        if not stored:
            return "forge: no session in the clear"
        values = list(rng.choice(stored))
        stored_ids = values[COLUMNS.index("token_ids")]
        if not isinstance(stored_ids, bytes) or not stored_ids:  # an earlier mutation's damage
            return f"forge: session {values[1]!r:.40} has no token ids to change"
        tokens = bytearray(stored_ids)
        at = rng.randrange(len(tokens))
        tokens[at] ^= 1 << rng.randrange(8)
        values[COLUMNS.index("token_ids")] = bytes(tokens)
        crc = row_crc(values[: len(COLUMNS)], values[len(COLUMNS)])
        db.execute(
            "UPDATE sessions SET token_ids = ?, row_crc = ? WHERE namespace = ? AND id = ?",
            (bytes(tokens), crc, values[0], values[1]),
        )
    return f"session {values[1]}: token id byte {at} changed, checksum recomputed"


MUTATIONS: dict[str, Mutation] = {
    "flip_bits": flip_bits,
    "zero_range": zero_range,
    "zero_index_page": zero_index_page,
    "copy_index_page": copy_index_page,
    "truncate": truncate,
    "extend": extend,
    "remove_file": remove_file,
    "foreign_file": foreign_file,
    "foreign_index": foreign_index,
    "garbage_wal": garbage_wal,
    "damage_row": damage_row,
    "forge_session_tokens": forge_session_tokens,
}
WEIGHTS: dict[str, int] = {
    "flip_bits": 6,
    "zero_range": 3,
    "zero_index_page": 3,
    "copy_index_page": 1,
    "truncate": 2,
    "extend": 1,
    "remove_file": 1,
    "foreign_file": 2,
    "foreign_index": 1,
    "garbage_wal": 1,
    "damage_row": 8,
    "forge_session_tokens": 2,
}


def pick(rng: random.Random, count: int) -> list[str]:
    """``count`` mutation names, drawn by weight (combined mutations: several in one trial)."""
    names = sorted(MUTATIONS)
    return rng.choices(names, weights=[WEIGHTS[n] for n in names], k=count)
