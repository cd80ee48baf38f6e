"""The server's opt-in memory watch (``KVSTRATA_MEMWATCH``): a sample splits what the process holds
(tracemalloc's total, glibc's heap, objects by type, tensors) and names the sites that grew."""

from __future__ import annotations

import json
import sqlite3
import tracemalloc
from pathlib import Path

import pytest
import torch

from kvstrata.server.memwatch import ENV_EVERY, ENV_PATH, MemWatch


class _Kept:
    pass


def test_a_sample_names_the_site_and_the_type_that_grew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_PATH, str(tmp_path / "watch.jsonl"))
    monkeypatch.setenv(ENV_EVERY, "3600")
    watch = MemWatch.from_env()
    assert watch is not None and watch.every_s == 3600
    was_tracing = tracemalloc.is_tracing()
    watch.start()
    try:
        watch.sample()
        kept = [_Kept() for _ in range(5000)]
        blob = [bytes(1000) for _ in range(2000)]  # about 2 MB from one line
        tensor = torch.zeros(1 << 18)  # 1 MiB
        db = sqlite3.connect(":memory:")
        db.execute("CREATE TABLE t (x BLOB)")
        db.executemany("INSERT INTO t VALUES (?)", [(bytes(100),)] * 10_000)  # pages in SQLite's cache
        line = watch.sample()
        db.close()
    finally:
        watch.stop()
        if not was_tracing:
            tracemalloc.stop()
    lines = [json.loads(x) for x in (tmp_path / "watch.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[1] == json.loads(json.dumps(line))
    assert line["rss"] >= line["rss_anon"] > 0 and line["traced"] > 2e6
    assert line["tracemalloc_own"] > 0  # the traces of the objects above, at least
    assert line["sqlite"] is None or line["sqlite"] > 1e6  # the table's pages
    assert line["threads"] > 0 and line["open_files"] > 0
    grown = dict(line["types_grown"])
    assert grown[f"{__name__}._Kept"] >= 5000
    top = line["sites_grown"][0]
    assert top["bytes"] >= 2e6 and top["where"][-1].startswith(__file__)
    assert line["tensors"] >= 1 and line["tensor_bytes"] >= tensor.nbytes
    if line["glibc"]:
        assert line["glibc"]["in_use"] > 0
    del kept, blob


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_PATH, raising=False)
    assert MemWatch.from_env() is None
