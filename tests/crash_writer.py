"""Child process for the crash test: writes sessions forever until it is SIGKILLed."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kvstrata import KVStore, StoreConfig
from kvstrata.policy.ladder import CodecLadder

from conftest import LAYOUT, token_kv


def main(root: str, seed: int) -> None:
    rng = random.Random(seed)
    config = StoreConfig(
        l1_budget_bytes=8 * LAYOUT.bytes_per_block,
        l2_budget_bytes=1 << 16,
        checkpoint_every_tokens=16,
        ladder=CodecLadder.exact(),
    )
    store = KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config)
    sessions = [store.create_session(f"s{i}", exist_ok=True) for i in range(4)]
    print("ready", flush=True)
    while True:
        session = rng.choice(sessions)
        n = rng.randint(1, 9)
        tokens = [rng.randrange(0, 50_000) for _ in range(n)]
        store.append(session, tokens, token_kv(LAYOUT, tokens, session.num_tokens))
        if rng.random() < 0.3:
            store.checkpoint(session)
        if rng.random() < 0.05 and session.num_tokens > 40:
            store.truncate(session, session.num_tokens // 2)
            store.checkpoint(session)
        if rng.random() < 0.02:
            child = f"{session.id}-fork{rng.randrange(1000)}"
            if store.index.sessions.get(session.namespace, child) is None:
                store.fork(session, child)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
