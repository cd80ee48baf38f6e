"""Child process for the eviction crash test: writes sessions over a small L3 budget (so that
every few writes evict) until it is SIGKILLed."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kvstrata import KVStore, StoreConfig
from kvstrata.policy.ladder import CodecLadder

from conftest import LAYOUT, token_kv

RECORD = LAYOUT.bytes_per_block + 92 + 4


def main(root: str, seed: int) -> None:
    rng = random.Random(seed)
    config = StoreConfig(
        l1_budget_bytes=0, l2_budget_bytes=0, ladder=CodecLadder.exact(), l3_budget_bytes=20 * RECORD
    )
    store = KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config)
    print("ready", flush=True)
    n = 0
    while True:
        session = store.create_session(f"s{seed}-{n}", exist_ok=True)
        tokens = [rng.randrange(0, 50_000) for _ in range(rng.randint(5, 20))]
        store.append(session, tokens, token_kv(LAYOUT, tokens))
        store.checkpoint(session)
        n += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
