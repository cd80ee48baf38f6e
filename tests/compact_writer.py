"""Child process for the compaction crash test: writes sessions, cuts most of them short (holes in
their segments), and compacts, over and over, until it is SIGKILLed."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kvstrata import GcConfig, KVStore, StoreConfig
from kvstrata.policy.ladder import CodecLadder

from conftest import LAYOUT, token_kv


def main(root: str, seed: int) -> None:
    rng = random.Random(seed)
    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0, ladder=CodecLadder.exact())
    store = KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config)
    print("ready", flush=True)
    gc = GcConfig(grace_s=0.0, unreferenced_after_s=0.0, compact_hole_fraction=0.2)
    n = 0
    while True:
        session = store.create_session(f"s{seed}-{n}", exist_ok=True)
        tokens = [rng.randrange(0, 50_000) for _ in range(rng.randint(4, 10) * LAYOUT.block_tokens)]
        store.append(session, tokens, token_kv(LAYOUT, tokens))
        store.checkpoint(session)
        store.truncate(session, rng.randint(1, len(tokens) // 2))
        store.checkpoint(session)
        store.maintenance.collect_garbage(gc)
        n += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
