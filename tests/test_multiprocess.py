"""Issue 15: one store, many processes (writers side by side, leases, gc beside them, kill -9)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvstrata import GcConfig, KVStore, SessionBusyError, StoreConfig
from kvstrata.policy.ladder import CodecLadder

from conftest import LAYOUT, token_kv
from stored import files_and_index

WORKER = Path(__file__).with_name("multiproc_worker.py")
_PY_CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from kvstrata import KVStore, StoreConfig
from kvstrata.policy.ladder import CodecLadder
from conftest import LAYOUT, token_kv
config = StoreConfig(ladder=CodecLadder.exact())
store = KVStore({root!r}, LAYOUT, model_fingerprint=b"test-model", config=config)
{body}
"""


def _child(root: Path, body: str) -> subprocess.Popen[str]:
    code = _PY_CHILD.format(tests=str(Path(__file__).parent), root=str(root), body=body)
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _store(root: Path) -> KVStore:
    return KVStore(
        root, LAYOUT, model_fingerprint=b"test-model", config=StoreConfig(ladder=CodecLadder.exact())
    )


def test_a_prefix_written_by_one_process_is_read_by_another(tmp_path: Path) -> None:
    root = tmp_path / "store"
    tokens = list(range(10))
    child = _child(
        root,
        "s = store.create_session('writer')\n"
        f"store.append(s, {tokens!r}, token_kv(LAYOUT, {tokens!r}))\n"
        "store.checkpoint(s)\nprint('written', flush=True)\nsys.stdin.readline()\nstore.close()",
    )
    child.stdin = None
    assert child.stdout is not None and child.stdout.readline().strip() == "written", child.stderr.read()  # type: ignore[union-attr]
    with _store(root) as reader:  # opened while the writer still has the store open
        keys = reader.match_prefix("default", tokens)
        assert len(keys) == 2  # the two full blocks the other process wrote
        loaded = reader.load_blocks(keys)
        assert torch.equal(loaded.kv, token_kv(LAYOUT, tokens[:8]))  # type: ignore[arg-type]
        session = reader.session("writer")
        assert torch.equal(reader.load(session).kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]
    child.kill()
    child.wait()


def test_leases_serialize_writers_and_a_dead_owner_loses_its_lease(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with _store(root) as store:
        store.create_session("shared")
    holder = _child(
        root,
        "with store.leased('shared'):\n    print('holding', flush=True)\n    time.sleep(600)",
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    with _store(root) as store:
        session = store.session("shared")
        with pytest.raises(SessionBusyError, match="another process"):
            store.append(session, [1, 2, 3], token_kv(LAYOUT, [1, 2, 3]))
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        store.append(session, [1, 2, 3], token_kv(LAYOUT, [1, 2, 3]))  # the dead owner's lease is taken over
        store.checkpoint(session)
        store.release("shared")
    with _store(root) as store:
        assert store.session("shared").token_ids == [1, 2, 3]


def test_a_stale_copy_is_refreshed_and_never_overwrites_a_newer_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "store"
    a = _store(root)
    session = a.create_session("agent")
    a.append(session, [1, 2, 3, 4, 5], token_kv(LAYOUT, [1, 2, 3, 4, 5]))
    a.checkpoint(session)
    a.release("agent")
    # another process continues the agent
    other = _child(
        root,
        "with store.leased('agent'):\n"
        "    s = store.session('agent')\n"
        "    store.append(s, [6, 7], token_kv(LAYOUT, [6, 7], 5))\n"
        "    store.checkpoint(s)\n"
        "store.close()\nprint('done', flush=True)",
    )
    out, err = other.communicate(timeout=120)
    assert out.strip() == "done", err
    fresh = a.session("agent")  # re-read: the other process checkpointed since
    assert fresh.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert torch.equal(a.load(fresh).kv, token_kv(LAYOUT, [1, 2, 3, 4, 5, 6, 7]))  # type: ignore[arg-type]
    a.close()


def test_many_writers_with_kill9_and_gc_beside_them_lose_nothing_checkpointed(tmp_path: Path) -> None:
    """Issue 15, acceptance 5: 4 processes append to their own sessions over shared prefixes, one is
    SIGKILLed and restarted, gc (grace 0) runs beside them; every checkpointed session reads back
    bit for bit, no orphan survives gc, nobody read a corrupt block."""
    root = tmp_path / "store"
    _store(root).close()
    rng = random.Random(15)
    rounds = 25
    outputs: dict[str, list[str]] = {}
    procs: dict[str, subprocess.Popen[str]] = {}
    readers: list[threading.Thread] = []

    def start(name: str, seed: int) -> None:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(root), name, str(seed), str(rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs[name] = proc
        lines = outputs.setdefault(name, [])

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.strip())

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        readers.append(thread)

    for i in range(4):
        start(f"w{i}", i)
    stop_gc = threading.Event()
    gc_errors: list[BaseException] = []

    def gc_loop() -> None:
        with _store(root) as gc_store:
            while not stop_gc.is_set():
                try:
                    gc_store.maintenance.collect_garbage(GcConfig(grace_s=0.0, unreferenced_after_s=0.0))
                except BaseException as exc:
                    gc_errors.append(exc)
                    return
                time.sleep(0.05)

    gc_thread = threading.Thread(target=gc_loop)
    gc_thread.start()
    victim = f"w{rng.randrange(4)}"
    deadline = time.monotonic() + 120
    while sum(line.startswith("ok") for line in outputs[victim]) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    procs[victim].send_signal(signal.SIGKILL)
    procs[victim].wait()
    start(f"{victim}b", 99)  # restarted under another name, continuing with new sessions
    for name, proc in procs.items():
        assert proc.wait(timeout=600) in (0, -signal.SIGKILL), (
            f"{name}: {proc.stderr.read() if proc.stderr else ''}"
        )
    stop_gc.set()
    gc_thread.join()
    for thread in readers:
        thread.join(timeout=10)
    assert not gc_errors, gc_errors
    for name, lines in outputs.items():
        assert not any(line.startswith("MISMATCH") for line in lines), name
        if name != victim:
            assert lines[-1] == "done corrupt=0", (name, lines[-3:])

    checkpointed: dict[str, list[int]] = {}
    for lines in outputs.values():
        for line in lines:
            if line.startswith("ok "):
                _, sid, n, *tokens = line.split()
                checkpointed[sid] = [int(t) for t in tokens]
                assert len(checkpointed[sid]) == int(n)
    assert len(checkpointed) > 4 * 5

    with _store(root) as store:
        report = store.maintenance.collect_garbage(GcConfig(grace_s=0.0, unreferenced_after_s=0.0))
        assert report.sessions_deleted == 0
        for sid, tokens in checkpointed.items():
            session = store.session(sid)
            assert session.token_ids == tokens, sid
            loaded = store.load(session)
            assert loaded.missing_from_token is None and torch.equal(loaded.kv, token_kv(LAYOUT, tokens)), sid
        on_disk, indexed = files_and_index(store)
        assert on_disk == indexed  # no orphan file, no row without its file
        assert store.counters.corrupt_blocks == 0
    assert not list((root / "quarantine").iterdir())


_OPEN_RACE_CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from kvstrata import KVStore, StoreConfig
from conftest import LAYOUT
for i in range({rounds}):
    time.sleep(max(0.0, {start} + i * 0.4 - time.time()))
    try:
        config = StoreConfig({config})
        KVStore({root!r} + f"/{{i}}", LAYOUT, model_fingerprint=b"test-model", config=config).close()
        print("ok", i, flush=True)
    except Exception as exc:
        print("failed", i, type(exc).__name__, exc, flush=True)
"""


def test_processes_creating_one_new_store_at_the_same_moment_all_open_it(tmp_path: Path) -> None:
    """vLLM's tensor-parallel workers open a new store_dir at once: the first open of a store by
    several processes (index created, marked, its layout recorded) is one transaction, so none of
    them sees a half-made index ("an SQLite file that kvstrata did not create")."""
    rounds, procs = 8, 4
    start = time.time() + 12  # every child imported kvstrata by then, even on a loaded machine
    code = _OPEN_RACE_CHILD.format(
        tests=str(Path(__file__).parent), root=str(tmp_path), rounds=rounds, start=start, config=""
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(procs)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    lines = [line for out, _ in outputs for line in out.splitlines()]
    assert [line for line in lines if not line.startswith("ok")] == [], [err[-2000:] for _, err in outputs]
    assert len(lines) == rounds * procs
    for i in range(rounds):
        with _store(tmp_path / str(i)) as store:
            assert store.layout == LAYOUT


def test_an_sqlite_file_kvstrata_did_not_create_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    import sqlite3

    from kvstrata.errors import StoreFormatError

    root = tmp_path / "store"
    root.mkdir()
    foreign = sqlite3.connect(root / "index.sqlite")
    foreign.execute("CREATE TABLE notes (text TEXT)")
    foreign.execute("INSERT INTO notes VALUES ('mine')")
    foreign.commit()
    foreign.close()
    before = (root / "index.sqlite").read_bytes()
    with pytest.raises(StoreFormatError, match="did not create"):
        _store(root)
    assert (root / "index.sqlite").read_bytes() == before  # not switched to WAL, not marked
    assert not (root / "index.sqlite-wal").exists()


def test_a_key_recorded_by_another_process_since_this_one_looked_is_not_overwritten(tmp_path: Path) -> None:
    """Two processes open a new encrypted store at once with different keys: both find no check
    value, then both record theirs. The interleaving is made deterministic here: the first
    process's value is already in the index when the second, which saw none, records its own."""
    from kvstrata.crypto import Keyring
    from kvstrata.errors import EncryptionKeyError
    from kvstrata.store.index import Index
    from kvstrata.store.keycheck import KEY_CHECK_META, check_encryption_key

    root = tmp_path / "store"
    root.mkdir()
    index = Index(root / "index.sqlite", LAYOUT)
    first, second = b"\x01" * 32, b"\x02" * 32
    index.set_meta(KEY_CHECK_META, Keyring(first).check_value())  # the other process won
    index.get_meta = lambda name: None  # type: ignore[method-assign]  # ... after this one looked
    with pytest.raises(EncryptionKeyError, match="another process opened it with another key"):
        check_encryption_key(root, index, second, read_only=False)
    del index.get_meta
    assert index.get_meta(KEY_CHECK_META) == Keyring(first).check_value()
    index.close()
