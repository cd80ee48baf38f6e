"""Session documents (``KVStore.documents``): stored, checked, sealed, and carried by the session's
life (fork, delete, TTL and gc, export and import, other processes)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstrata import ConfigError, KVStore, KVStrataError, SessionNotFoundError, StoreConfig
from kvstrata.config import GcConfig
from kvstrata.errors import CorruptBlockError, EncryptionKeyError
from kvstrata.store import archive
from kvstrata.store.index.documents import DocumentRow

from conftest import LAYOUT, token_kv

Factory = Callable[..., KVStore]
KEY = bytes(range(32))


def _session(store: KVStore, sid: str = "a", namespace: str = "default", tokens: int = 10) -> None:
    session = store.create_session(sid, namespace)
    ids = list(range(1, tokens + 1))
    store.append(session, ids, token_kv(LAYOUT, ids))
    store.checkpoint(session)


def test_put_get_replace_delete_names(open_store: Factory) -> None:
    store = open_store()
    _session(store)
    docs = store.documents
    assert docs.get("a", "chat") is None
    docs.put("a", "chat", b"one")
    docs.put("a", "chat", b"two")  # replaces
    docs.put("a", "response:r1", b"{}")
    docs.put("a", "response:r2", b"[]")
    assert docs.get("a", "chat") == b"two"
    assert docs.names("a") == ["chat", "response:r1", "response:r2"]
    assert docs.names("a", prefix="response:") == ["response:r1", "response:r2"]
    assert docs.names("a", prefix="resp%") == []  # a prefix is text, not a pattern
    assert docs.delete("a", "response:r1") is True
    assert docs.delete("a", "response:r1") is False
    assert docs.names("a", prefix="response:") == ["response:r2"]
    assert docs.names("nobody") == []


def test_put_needs_the_session_and_a_valid_name(open_store: Factory) -> None:
    store = open_store()
    with pytest.raises(SessionNotFoundError):
        store.documents.put("missing", "chat", b"x")
    _session(store)
    with pytest.raises(SessionNotFoundError):  # sessions are per namespace
        store.documents.put("a", "chat", b"x", namespace="other")
    for bad in ("", "x" * 257, "a\x00b"):
        with pytest.raises(ConfigError):
            store.documents.put("a", bad, b"x")


def test_find_prefers_the_session_that_wrote_it_over_a_forks_copy(open_store: Factory) -> None:
    store = open_store()
    _session(store, "a")
    store.documents.put("a", "response:r1", b"from a")
    store.fork(store.session("a"), "b")
    assert store.documents.get("b", "response:r1") == b"from a"  # the fork carries it
    assert store.documents.find("response:r1") == ("a", b"from a")
    store.documents.put("b", "response:r2", b"from b")
    assert store.documents.find("response:r2") == ("b", b"from b")
    assert store.documents.find("response:r1", namespace="other") is None
    store.delete_session("a")
    assert store.documents.find("response:r1") == ("b", b"from a")  # the copy, once the original is gone
    assert store.documents.find("response:none") is None


def test_delete_ttl_and_gc_take_documents_with_the_session(open_store: Factory) -> None:
    store = open_store()
    _session(store, "a")
    _session(store, "keep")
    store.create_session("short", ttl_s=1.0)
    store.documents.put("a", "chat", b"a's")
    store.documents.put("short", "chat", b"short's")
    store.documents.put("keep", "chat", b"keep's")
    store.delete_session("a")
    assert store.documents.get("a", "chat") is None
    _session(store, "a")  # a new session of the same id starts with no documents
    assert store.documents.names("a") == []
    store.maintenance.collect_garbage(GcConfig(grace_s=0.0), now=time.time() + 5)  # past short's TTL
    assert store.documents.get("short", "chat") is None
    assert store.documents.get("keep", "chat") == b"keep's"
    assert store.index.documents.count() == 1


def test_gc_sweeps_documents_whose_session_row_is_gone(open_store: Factory) -> None:
    store = open_store()
    _session(store, "a")
    store.documents.put("a", "chat", b"x")
    with store.index.transaction() as db:  # what a build without documents leaves when it deletes
        db.execute("DELETE FROM sessions WHERE id = 'a'")
    store.maintenance.collect_garbage(GcConfig(grace_s=0.0))
    assert store.index.documents.count() == 0


def test_export_import_carries_documents(open_store: Factory, tmp_path: Path) -> None:
    store = open_store()
    _session(store, "a")
    store.documents.put("a", "chat", "ünïcode transcript".encode())
    store.documents.put("a", "response:r1", b"\x00\xffbinary")
    data = store.archives.export_session(store.session("a"))
    assert archive.read_archive(data).documents[0].name == "chat"
    other = open_store(tmp_path / "other")
    other.archives.import_session(data, new_id="b", namespace="t2")
    assert other.documents.get("b", "chat", namespace="t2") == "ünïcode transcript".encode()
    assert other.documents.names("b", namespace="t2") == ["chat", "response:r1"]
    damaged = bytearray(data)
    at = bytes(data).index(b"response:r1")
    damaged[at] ^= 1
    with pytest.raises(CorruptBlockError):  # the archive's CRC covers its documents
        archive.read_archive(bytes(damaged))


def test_a_damaged_document_row_is_refused_not_returned(open_store: Factory) -> None:
    store = open_store()
    _session(store, "a")
    store.documents.put("a", "chat", b"hello world")
    with store.index.transaction() as db:
        db.execute("UPDATE session_documents SET data = ? WHERE name = 'chat'", (b"hello worle",))
    with pytest.raises(CorruptBlockError, match="CRC32C"):
        store.documents.get("a", "chat")
    with store.index.transaction() as db:
        db.execute("UPDATE session_documents SET data = 5 WHERE name = 'chat'")
    with pytest.raises(CorruptBlockError, match="wrong types"):
        store.documents.get("a", "chat")


def test_encrypted_documents_are_sealed_and_bound_to_their_session(
    open_store: Factory, tmp_path: Path
) -> None:
    store = open_store(encryption_key=KEY)
    _session(store, "a")
    _session(store, "b")
    store.documents.put("a", "chat", b"my bank password is zebra-horse-42")
    store.documents.put("b", "chat", b"b's own")
    store.close()
    index = (tmp_path / "store" / "index.sqlite").read_bytes()
    wal = tmp_path / "store" / "index.sqlite-wal"
    assert b"zebra-horse" not in index + (wal.read_bytes() if wal.exists() else b"")
    store = open_store(encryption_key=KEY)
    assert store.documents.get("a", "chat") == b"my bank password is zebra-horse-42"
    store.fork(store.session("a"), "c")  # sealed again for the fork
    assert store.documents.get("c", "chat") == b"my bank password is zebra-horse-42"
    with store.index.transaction() as db:  # a's sealed document moved under b's name: refused
        (sealed,) = db.execute("SELECT data FROM session_documents WHERE session_id = 'a'").fetchone()
        db.execute("DELETE FROM session_documents WHERE session_id = 'b'")
    store.index.documents.put(DocumentRow("default", "b", "chat", sealed, sealed=True))
    with pytest.raises(CorruptBlockError, match="authentication"):
        store.documents.get("b", "chat")
    store.close()
    with pytest.raises(EncryptionKeyError):  # no key: not even read
        KVStore(tmp_path / "store", read_only=True)
    reader = KVStore(tmp_path / "store", read_only=True, config=StoreConfig(encryption_key=KEY))
    try:
        assert reader.documents.get("c", "chat") == b"my bank password is zebra-horse-42"
        with pytest.raises(KVStrataError):
            reader.documents.put("a", "chat", b"x")
    finally:
        reader.close()


def test_another_process_sees_writes(open_store: Factory, tmp_path: Path) -> None:
    store = open_store()
    _session(store, "a")
    script = textwrap.dedent(
        f"""
        from kvstrata import KVStore, StoreConfig
        with KVStore({str(tmp_path / "store")!r}, model_fingerprint=b"test-model") as s:
            assert s.documents.get("a", "chat") is None
            s.documents.put("a", "chat", b"from the other process")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert store.documents.get("a", "chat") == b"from the other process"
    store.documents.put("a", "chat", b"back")
    with sqlite3.connect(tmp_path / "store" / "index.sqlite") as db:
        assert db.execute("SELECT count(*) FROM session_documents").fetchone()[0] == 1
