"""The run that is recorded: several agents' sessions checkpointed one after another into a new
store (appends, a fork, a truncation, a deletion, a gc that removes what the deletion freed), with
a marker after every call that returned, so a crash state knows what the caller was told.

Run as ``python -m kvstrata.bench.crash.workload ROOT MODE SEED STEPS MARKS`` under the recorder;
markers are JSON lines written to the file ``MARKS`` (the recorder turns them into events).
The KV of a token is a pure function of (token, position) (:func:`expected_kv`), so any state's
sessions can be checked bit for bit without the run's tensors.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import torch

from kvstrata.config import GcConfig, StoreConfig
from kvstrata.layout import KVLayout
from kvstrata.policy.ladder import CodecLadder

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)
MODEL = b"crash-harness"
SESSIONS = 4


def store_config(mode: str) -> StoreConfig:
    """Every block to L3 as it comes (no memory tiers), stored exact (so KV compares bit for bit)."""
    return StoreConfig(
        l1_budget_bytes=0,
        l2_budget_bytes=0,
        ladder=CodecLadder.exact(),
        checkpoint_every_tokens=1 << 30,
        durability=mode,
    )


def expected_kv(tokens: list[int], start: int = 0) -> torch.Tensor:
    """The KV of ``tokens`` from position ``start`` (a pure function of token and position)."""
    gen = torch.Generator().manual_seed(1234)
    base = torch.randn(LAYOUT.block_shape(1), generator=gen)
    tok = torch.tensor(tokens, dtype=torch.float32).view(1, 1, 1, -1, 1)
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32).view(1, 1, 1, -1, 1)
    return (base * torch.sin(tok * 0.37 + pos * 0.011) + tok * 1e-3).to(LAYOUT.torch_dtype)


def run(root: Path, mode: str, seed: int, steps: int, marks: Path) -> None:
    from kvstrata.store import KVStore

    rng = random.Random(seed)
    fd = os.open(marks, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def mark(event: str, **fields: object) -> None:
        os.write(fd, (json.dumps({"event": event, **fields}) + "\n").encode())

    def checkpointed(session: object) -> None:
        mark("checkpoint", id=session.id, version=session.version, tokens=list(session.token_ids))  # type: ignore[attr-defined]

    store = KVStore(root, LAYOUT, model_fingerprint=MODEL, config=store_config(mode))
    mark("opened")
    ids = [f"agent{i}" for i in range(SESSIONS)]
    for sid in ids:
        checkpointed(store.create_session(sid))
    plan = ["append"] * steps
    for i, special in zip(rng.sample(range(3, steps), 4), ("fork", "truncate", "delete", "gc"), strict=True):
        plan[i] = special
    for action in plan:
        live = [sid for sid in ids if store.index.sessions.version("default", sid) is not None]
        sid = rng.choice(live)
        session = store.session(sid)
        if action == "append":
            tokens = [rng.randrange(1, 60_000) for _ in range(rng.randint(1, 13))]
            store.append(session, tokens, expected_kv(tokens, session.num_tokens))
            store.checkpoint(session)
            checkpointed(session)
        elif action == "fork":
            child = store.fork(session, f"{sid}-fork")
            ids.append(child.id)
            checkpointed(child)
        elif action == "truncate" and session.num_tokens > 2:
            store.truncate(session, rng.randrange(1, session.num_tokens))
            store.checkpoint(session)
            checkpointed(session)
        elif action == "delete":
            mark("deleting", id=sid)
            store.delete_session(sid)
            mark("deleted", id=sid)
        elif action == "gc":
            store.maintenance.collect_garbage(GcConfig(grace_s=0.0, unreferenced_after_s=0.0))
            mark("gc")
    store.close()
    mark("closed")


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
