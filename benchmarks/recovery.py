"""Recovery time: reopen a store holding 1,000 sessions and 50,000 blocks (issue 2, point 5).

Builds the store once (files and index rows written in bulk, without per-file fsync: this is
fixture generation, not the crash-safe write path), then reopens it in fresh processes and
reports the time ``KVStore(...)`` takes, which includes removing temp files, loading every block
row of the index into memory and allocating the memory tiers.

    python benchmarks/recovery.py [--dir DIR] [--sessions 1000] [--blocks 50000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstrata import KVLayout, KVStore, StoreConfig
from kvstrata.codecs import CodecId, EncodedBlock
from kvstrata.keys import BlockKey, chain_key, root_key
from kvstrata.store.kvbin import encode_record
from kvstrata.store.sessions import Session

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=64)


def build(root: Path, sessions: int, blocks: int) -> None:
    store = KVStore(
        root, LAYOUT, model_fingerprint=b"bench", config=StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)
    )
    per_session = blocks // sessions
    payload = bytes(LAYOUT.bytes_per_block)
    rng = np.random.default_rng(0)
    rows = []
    now = time.time()
    for s in range(sessions):
        tokens = rng.integers(0, 49_152, per_session * LAYOUT.block_tokens).tolist()
        parent = root_key(b"bench", LAYOUT, "default")
        keys: list[BlockKey] = []
        for b in range(per_session):
            parent = chain_key(parent, tokens[b * 64 : (b + 1) * 64])
            keys.append(parent)
            record = encode_record(
                parent, EncodedBlock(CodecId.IDENTITY, b"", payload, 64), LAYOUT.fingerprint
            )
            path = store.disk.path_for(parent)
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(record)
            rows.append((parent, 0, 64, b * 64, 0, len(record), now, now, 0))
        session = Session("default", f"agent-{s:04d}", b"bench", tokens, keys)
        store.index.sessions.put(session.to_row())
    with store.index.transaction() as db:
        db.executemany(
            "INSERT OR REPLACE INTO blocks (key, cold, num_tokens, start_pos, codec, nbytes, created, "
            "last_access, access_count) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        db.execute("DELETE FROM block_usage")
        db.execute("INSERT INTO block_usage SELECT '', count(*), total(nbytes) FROM blocks")
    store.close()


def measure_once(root: Path) -> float:
    code = (
        "import time, sys; from kvstrata import KVStore;"
        f"t = time.perf_counter(); s = KVStore({str(root)!r}); d = time.perf_counter() - t;"
        "assert s.disk.usage().blocks > 0; print(d, s.disk.usage().blocks, len(s.list_sessions()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="kvstrata-recovery-")) / "store"
    if not (root / "index.sqlite").exists():
        t = time.perf_counter()
        build(root, args.sessions, args.blocks)
        print(
            f"built {args.blocks} blocks / {args.sessions} sessions in {time.perf_counter() - t:.1f} s",
            file=sys.stderr,
        )
    # leave a few temp files as a crashed writer would
    for i in range(3):
        (root / "tmp" / f"crashed-{i}.tmp").write_bytes(os.urandom(128))
    times = [measure_once(root) for _ in range(args.repeats)]
    result = {
        "sessions": args.sessions,
        "blocks": args.blocks,
        "open_seconds": times,
        "median_s": statistics.median(times),
        "max_s": max(times),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
