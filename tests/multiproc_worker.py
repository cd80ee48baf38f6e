"""Child process for the many-writers test: sessions of its own over shared prefixes, one store.

Prints ``ok <session> <num_tokens>`` after each checkpoint (what must survive), ``done corrupt=N``
at the end. Any KV read back that differs from what its tokens must give exits with status 3.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from kvstrata import KVStore, StoreConfig
from kvstrata.policy.ladder import CodecLadder

from conftest import LAYOUT, token_kv

# three shared prefixes of 2-3 full blocks (block_tokens is 4)
PREFIXES = [list(range(100, 108)), list(range(200, 212)), list(range(300, 310))]


def main(root: str, worker: str, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    config = StoreConfig(checkpoint_every_tokens=1_000_000, ladder=CodecLadder.exact())
    store = KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config)
    print("ready", flush=True)
    for r in range(rounds):
        sid = f"{worker}-{seed}-{r}"
        prefix = PREFIXES[r % len(PREFIXES)]
        with store.leased(sid):
            session = store.create_session(sid, exist_ok=True)
            for turn in range(rng.randint(1, 2)):
                tokens = (prefix if turn == 0 else []) + [
                    rng.randrange(1000, 50_000) for _ in range(rng.randint(1, 9))
                ]
                shared = store.match_prefix("default", session.token_ids + tokens)
                if shared and turn == 0:
                    loaded = store.load_blocks(shared)  # another process may have written these
                    expected = token_kv(LAYOUT, (session.token_ids + tokens)[: loaded.num_tokens])
                    if loaded.kv is not None and not torch.equal(loaded.kv, expected):
                        print(f"MISMATCH {sid}", flush=True)
                        sys.exit(3)
                store.append(session, tokens, token_kv(LAYOUT, tokens, session.num_tokens))
                store.checkpoint(session)
                print(f"ok {sid} {session.num_tokens} {' '.join(map(str, session.token_ids))}", flush=True)
    print(f"done corrupt={store.counters.corrupt_blocks}", flush=True)
    store.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
