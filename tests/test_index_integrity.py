"""Issue 30, gap 6: every byte of the index the store trusts is checked before use, and every failure
of the index is a kvstrata error of one line (the command line included); a failing close still
releases what it holds."""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata import KVStore, StoreConfig
from kvstrata.cli.main import app
from kvstrata.errors import CorruptBlockError, KVStrataError, StoreFormatError
from kvstrata.store.index.db import INDEX_FORMAT_VERSION
from kvstrata.store.index.session_codec import row_crc
from kvstrata.store.index.session_rows import COLUMNS, TABLE

from conftest import LAYOUT, token_kv

Factory = Callable[..., KVStore]
TOKENS = list(range(50, 73))  # 5 full blocks and a tail


def _store_with_session(open_store: Factory, root: Path) -> None:
    store = open_store(root)
    session = store.create_session("s")
    store.append(session, TOKENS, token_kv(LAYOUT, TOKENS))
    store.checkpoint(session)
    other = store.create_session("t")
    store.append(other, TOKENS[:9], token_kv(LAYOUT, TOKENS[:9]))
    store.checkpoint(other)
    store.close()


def _update(root: Path, sql: str, args: tuple[object, ...] = ()) -> None:
    with sqlite3.connect(root / "index.sqlite") as db:
        db.execute(sql, args)


def test_a_flipped_bit_in_a_session_rows_token_ids_is_refused(open_store: Factory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    with sqlite3.connect(root / "index.sqlite") as db:
        (tokens,) = db.execute("SELECT token_ids FROM sessions WHERE id = 's'").fetchone()
        damaged = bytearray(tokens)
        damaged[9] ^= 0x04
        db.execute("UPDATE sessions SET token_ids = ? WHERE id = 's'", (bytes(damaged),))
    store = open_store(root)
    with pytest.raises(CorruptBlockError, match="CRC32C") as refused:
        store.session("s")
    assert "\n" not in str(refused.value) and "s" in str(refused.value)
    assert store.session("t").token_ids == TOKENS[:9]  # the other session is served as it was


def test_token_ids_that_do_not_hash_to_the_block_keys_are_refused_even_under_a_good_checksum(
    open_store: Factory, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    with sqlite3.connect(root / "index.sqlite") as db:
        values = list(db.execute(f"SELECT {', '.join(TABLE.names)} FROM sessions WHERE id = 's'").fetchone())
        tokens = bytearray(values[COLUMNS.index("token_ids")])
        tokens[4] ^= 0x01  # token 1 becomes another token: a row a bug could write
        values[COLUMNS.index("token_ids")] = bytes(tokens)
        crc = row_crc(values[: len(COLUMNS)], values[len(COLUMNS)])
        db.execute("UPDATE sessions SET token_ids = ?, row_crc = ? WHERE id = 's'", (bytes(tokens), crc))
    store = open_store(root)
    with pytest.raises(CorruptBlockError, match="do not hash to its block keys"):
        store.session("s")


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("codec", 99),
        ("codec", "int8"),
        ("nbytes", -1),
        ("nbytes", 1 << 40),
        ("seg_offset", -5),
        ("num_tokens", "four"),
        ("num_tokens", 10**6),
        ("file_id", "ab\x00cd"),  # a NUL: ValueError from the system call if made into a path
        ("file_id", "../../etc"),  # would leave the store's directory
    ],
)
def test_a_damaged_block_row_is_a_corrupt_block_not_a_value_error(
    open_store: Factory, tmp_path: Path, column: str, value: object
) -> None:
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    _update(root, f"UPDATE OR IGNORE blocks SET {column} = ?", (value,))
    store = open_store(root, l1_budget_bytes=0, l2_budget_bytes=0)
    session = store.session("s")
    try:
        loaded = store.load(session)
    except KVStrataError:
        pass  # refused: fine
    else:
        assert loaded.num_tokens < len(TOKENS)  # not served from a damaged row
    with pytest.raises(KVStrataError):
        list(store.index.blocks)


@pytest.mark.parametrize("name", [b"file_id", b"namespace", b"token_ids"])
def test_a_schema_whose_text_is_not_utf8_is_a_kvstrata_error_of_one_line(
    open_store: Factory, tmp_path: Path, name: bytes
) -> None:
    """A flipped bit in the schema's text (SQLite stores it unchecked): a column name Python cannot
    decode raised UnicodeDecodeError from the driver before SQLite saw a query."""
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    data = bytearray((root / "index.sqlite").read_bytes())
    data[data.index(name) + 2] = 0xFF  # the first mention: in the schema, on the first pages
    (root / "index.sqlite").write_bytes(bytes(data))
    with pytest.raises(StoreFormatError) as refused:
        open_store(root)
    assert "\n" not in str(refused.value)
    result = CliRunner().invoke(app, ["sessions", "list", "--store", str(root)])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("name", "miscased"), [(b"pinned", b"pInned"), (b"file_id", b"filE_id")])
def test_a_column_name_whose_case_a_flipped_bit_changed_is_refused_in_one_line(
    open_store: Factory, tmp_path: Path, name: bytes, miscased: bytes
) -> None:
    """One bit (0x20) flipped in a column's name in the schema: SQLite still matches the name
    without case, but a result column came back under the new name (a ``KeyError`` in a listing,
    from the fuzz suite's seed 86,341). The index is refused at open, and the commands say so in
    one line."""
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    data = bytearray((root / "index.sqlite").read_bytes())
    at = data.index(b" " + name + b" ") + 1  # the first mention: in the schema, on the first pages
    data[at : at + len(name)] = miscased
    (root / "index.sqlite").write_bytes(bytes(data))
    with pytest.raises(StoreFormatError, match="index is damaged") as refused:
        open_store(root)
    assert miscased.decode() in str(refused.value) and "\n" not in str(refused.value)
    for args in (["sessions", "list"], ["store", "stats"], ["gc"]):
        result = CliRunner().invoke(app, [*args, "--store", str(root)])
        assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, (args, result.output)
        assert "Traceback" not in result.output


@pytest.mark.parametrize(("table", "column"), [("sessions", "id"), ("blocks", "file_id"), ("meta", "value")])
def test_a_row_whose_text_is_not_utf8_is_a_kvstrata_error(
    open_store: Factory, tmp_path: Path, table: str, column: str
) -> None:
    """A flipped bit in a TEXT value of a row: refused in one line or the other rows served."""
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    where = "id = 's'" if table == "sessions" else "1"  # one session; every row of the others
    _update(root, f"UPDATE {table} SET {column} = CAST(? AS TEXT) WHERE {where}", (b"rt-\xa0",))
    try:
        store = open_store(root, l1_budget_bytes=0, l2_budget_bytes=0)
        store.list_sessions()
        store.stats()
        for sid, tokens in (("s", TOKENS), ("t", TOKENS[:9])):
            try:
                session = store.session(sid)
                loaded = store.load(session)
            except KVStrataError as exc:
                assert "\n" not in str(exc)
                continue
            assert session.token_ids == tokens and loaded.num_tokens <= len(tokens)
        store.close()
    except KVStrataError as exc:  # refused as a whole: fine, in one line
        assert "\n" not in str(exc)


def _zero_page(root: Path, page: int) -> None:
    with (root / "index.sqlite").open("r+b") as f:
        f.seek(page * 4096)
        f.write(bytes(4096))


def test_every_index_page_zeroed_gives_a_kvstrata_error_or_a_working_store(
    open_store: Factory, tmp_path: Path
) -> None:
    template = tmp_path / "template"
    _store_with_session(open_store, template)
    pages = (template / "index.sqlite").stat().st_size // 4096
    assert pages >= 8
    outcomes = []
    for page in range(pages):
        root = tmp_path / f"p{page}"
        root.mkdir()
        (root / "index.sqlite").write_bytes((template / "index.sqlite").read_bytes())
        for sub in ("segments", "hot", "cold"):
            if (template / sub).exists():
                (root / sub).symlink_to(template / sub)
        _zero_page(root, page)
        try:
            with KVStore(root, config=StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)) as store:
                store.list_sessions()
                store.stats()
                for sid, tokens in (("s", TOKENS), ("t", TOKENS[:9])):
                    try:
                        session = store.session(sid)
                    except KVStrataError:
                        continue
                    assert session.token_ids == tokens
            outcomes.append("works")
        except KVStrataError as exc:
            assert "\n" not in str(exc)
            outcomes.append(type(exc).__name__)
    assert "StoreFormatError" in outcomes  # the check can fail: most pages matter


def test_the_commands_print_one_line_on_a_store_with_a_zeroed_index_page(
    open_store: Factory, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    _zero_page(root, 1)  # the first page after the header: sqlite_master's tables live around it
    for args in (["sessions", "list"], ["store", "stats"], ["gc"], ["sessions", "show", "s"]):
        result = CliRunner().invoke(app, [*args, "--store", str(root)])
        assert isinstance(result.exception, SystemExit) and result.exit_code == 1, (args, result.exception)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output, (
            result.stderr
        )
    segment = next((root / "segments").iterdir())
    inspected = CliRunner().invoke(app, ["inspect", str(root / "index.sqlite")])
    assert inspected.exit_code == 1 and len(inspected.stderr.strip().splitlines()) == 1
    assert CliRunner().invoke(app, ["inspect", str(segment)]).exit_code == 0  # the data is fine


def test_a_readers_close_on_a_full_disk_raises_nothing_and_releases_everything(
    open_store: Factory, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    store = open_store(root, l1_budget_bytes=0, l2_budget_bytes=0)
    assert store.load(store.session("s")).num_tokens == len(TOKENS)  # access times to save at close
    conn = store.index.db._db
    assert conn is not None

    class FullDisk:
        """The connection of a disk with no room left: reads work, writes fail as SQLite fails."""

        def __getattr__(self, name: str) -> object:
            return getattr(conn, name)

        def execute(self, sql: str, *args: object) -> object:
            if sql.split()[0].upper() in ("BEGIN", "INSERT", "UPDATE", "DELETE", "COMMIT"):
                raise sqlite3.OperationalError("database or disk is full")
            return conn.execute(sql, *args)

    store.index.db._db = FullDisk()  # type: ignore[assignment]
    lock_file = store.processes.dir / f"{store.processes.token}.lock"  # type: ignore[union-attr]
    assert lock_file.exists()
    store.close()  # no error: access times and figures are best effort
    assert not lock_file.exists() and store.index.closed
    conn.close()


def test_a_failing_close_still_releases_the_process_lock(open_store: Factory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    store = open_store(root)
    lock_file = store.processes.dir / f"{store.processes.token}.lock"  # type: ignore[union-attr]

    def fail() -> None:
        raise StoreFormatError("the index could not be closed")

    store.tiered.close = fail  # type: ignore[method-assign]
    with pytest.raises(StoreFormatError):
        store.close()
    assert not lock_file.exists() and store.index.closed


def test_a_format_3_store_gets_checksummed_rows(open_store: Factory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    with sqlite3.connect(root / "index.sqlite") as db:  # as a build before format 4 left it
        db.execute("ALTER TABLE sessions DROP COLUMN row_crc")
        db.execute("ALTER TABLE sessions DROP COLUMN sealed")
        db.execute("UPDATE meta SET value = '3' WHERE name = 'format_version'")
    with KVStore(root, read_only=True) as old:  # read as it is
        assert old.session("s").token_ids == TOKENS
    store = open_store(root)
    assert store.index.get_meta("format_version") == str(INDEX_FORMAT_VERSION)
    assert store.session("s").token_ids == TOKENS
    store.close()
    _update(root, "UPDATE sessions SET row_crc = NULL WHERE id = 's'")
    with pytest.raises(CorruptBlockError, match="lost its checksum"):
        open_store(root).session("s")


def test_gc_prints_one_line_whichever_index_page_is_zeroed(open_store: Factory, tmp_path: Path) -> None:
    # SQLite's own check can answer in several lines (e.g. "*** in database main ***\nPage 10: ..."):
    # gc's refusal quotes it, and must still be one line (found by `kvstrata bench fuzz`, seed 9180)
    template = tmp_path / "template"
    _store_with_session(open_store, template)
    pages = (template / "index.sqlite").stat().st_size // 4096
    refused = 0
    for page in range(1, pages):
        root = tmp_path / f"p{page}"
        shutil.copytree(template, root)
        _zero_page(root, page)
        result = CliRunner().invoke(app, ["gc", "--store", str(root)])
        assert result.exit_code in (0, 1) and "Traceback" not in result.output, (page, result.output)
        assert len(result.stderr.strip().splitlines()) <= 1, (page, result.stderr)
        refused += result.exit_code == 1
    assert refused  # most pages matter: the check can fail


@pytest.mark.parametrize("value", ["{", "inf", "nan"])
def test_gc_refuses_in_one_line_when_the_index_creation_time_is_damaged(
    open_store: Factory, tmp_path: Path, value: str
) -> None:
    # gc's age rule reads the index's creation time (found by `kvstrata bench fuzz`, seed 59930:
    # ValueError: could not convert string to float: '{')
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    _update(root, "UPDATE meta SET value = ? WHERE name = 'created'", (value,))
    # the index's own files left out: SQLite removes its -wal and -shm files when the last
    # connection to it closes (gc's, once this test's is closed)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("index.sqlite"))
    assert files  # the session's blocks, segment and journal
    result = CliRunner().invoke(app, ["gc", "--store", str(root)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "creation time is damaged" in result.stderr
    assert all(p.exists() for p in files)  # nothing deleted


@pytest.mark.parametrize("column", ["created", "last_access", "ttl_s"])
def test_gc_on_a_session_row_with_a_damaged_time_skips_it_in_one_line(
    open_store: Factory, tmp_path: Path, column: str
) -> None:
    # gc's TTL and retention rules read each row's times (found by `kvstrata bench fuzz`, seed
    # 63010: sessions.created set to 'yesterday' raised ValueError: could not convert string to float)
    root = tmp_path / "store"
    _store_with_session(open_store, root)
    _update(root, f"UPDATE sessions SET {column} = 'yesterday' WHERE id = 's'")
    result = CliRunner().invoke(app, ["gc", "--store", str(root)])
    assert result.exit_code in (0, 1) and "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, ValueError), result.exception
    assert len(result.stderr.strip().splitlines()) <= 1, result.stderr
    store = open_store(root)
    assert store.session("t").token_ids == TOKENS[:9]  # the healthy session is kept
    store.close()
