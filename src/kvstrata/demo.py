"""The main job: agents that share a system prompt, talk for several turns, survive a restart.

``kvstrata demo`` runs two phases, each in its own process (a real restart in between): phase 1
plays the first half of every agent's turns, phase 2 continues the same sessions from the store on
disk. Every turn is measured twice, side by side in the same process: with kvstrata (reuse what
the store holds, prefill the rest) and as a full recompute of the same prompt. Phases report JSON
lines on stdout; the ``demo`` command collects them into one table.

STORE_ROOT is a store root like every command's ``--store``: the demo's store is
``STORE_ROOT/<layout>/``, marked as the demo's (``kvstrata demo`` empties only such stores).

    python -m kvstrata.demo PHASE STORE_ROOT [options]      (what ``kvstrata demo`` spawns)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.store import KVStore
    from kvstrata.store.sessions import Session

ROLES = ["historian", "lawyer", "poet", "economist", "teacher", "journalist", "critic", "translator"]
PRIORITIES = ["realtime", "interactive", "background"]
QUESTIONS = [
    "In two sentences, who is Joseph and why do his brothers resent him?",
    "What happens to Joseph in Egypt? Answer briefly.",
    "Which dream does Joseph interpret for Pharaoh, and what does it foretell?",
    "Why do the brothers travel to Egypt? Keep it short.",
    "What lesson would your audience take from this story?",
    "Name one detail of the story that a reader might overlook.",
]
# Written into the demo's store before anything else: ``kvstrata demo`` empties a store only if it
# carries this mark, so it never deletes a store the demo did not make.
DEMO_MARK = "kvstrata-demo.txt"
TRANSCRIPTS = "demo-transcripts.json"


@dataclass(slots=True)
class TurnRecord:
    agent: str
    priority: str
    turn: int
    phase: int
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    prefill_tokens: int
    ttft_ms: float
    recompute_ttft_ms: float
    same_output: bool
    reply: str
    l1_codecs: dict[str, int] = field(default_factory=dict)
    """After the turn: the agent's blocks in device memory, per codec they are held in."""


def l1_codecs(store: KVStore, session: Session) -> dict[str, int]:
    """How many of ``session``'s blocks device memory holds, per codec (identity: exact)."""
    from kvstrata.codecs import CodecId
    from kvstrata.tiering import TierLevel

    l1 = store.tiered.tier(TierLevel.L1)
    out: dict[str, int] = {}
    for key in session.all_keys():
        codec = l1.codec_of(key)
        if codec is not None:
            name = CodecId(codec).name.lower()
            out[name] = out.get(name, 0) + 1
    return out


def shared_context(max_chars: int) -> str:
    text = resources.files("kvstrata.eval").joinpath("data/kjv_genesis_37_43.txt").read_text()
    return text[:max_chars].rsplit(" ", 1)[0]


def system_prompt(agent: int, context_chars: int) -> str:
    # the shared text comes first, so every agent's prompt starts with the same token blocks
    return (
        "You are one of several assistant agents working from the same reference text.\n\n"
        f"REFERENCE TEXT:\n{shared_context(context_chars)}\n\n"
        f"You are agent {agent}, a {ROLES[agent % len(ROLES)]}. Answer briefly."
    )


def run_phase(args: argparse.Namespace) -> None:
    import torch

    from kvstrata import KVStore, StoreConfig
    from kvstrata.config import MiB, encryption_key_from_env
    from kvstrata.engine import Engine
    from kvstrata.integrations.transformers.model import load_model
    from kvstrata.store.roots import store_for_layout
    from kvstrata.tiering import RemoteConfig

    torch.manual_seed(0)
    loaded = load_model(args.model, attn_implementation="sdpa", progress=not args.quiet)
    layout = loaded.layout(64)
    store_dir = store_for_layout(Path(args.store), layout)
    if args.phase == 1:
        store_dir.mkdir(parents=True, exist_ok=True)
        (store_dir / DEMO_MARK).write_text("made by `kvstrata demo`; the next `kvstrata demo` empties it\n")
    remote = RemoteConfig(args.remote, cluster=args.remote_cluster) if args.remote else None
    config = StoreConfig(
        l1_budget_bytes=args.l1_mib * MiB,
        l2_budget_bytes=args.l2_mib * MiB,
        remote=remote,
        encryption_key=encryption_key_from_env(),
    )
    transcripts_path = store_dir / TRANSCRIPTS
    transcripts: dict[str, list[dict[str, str]]] = (
        json.loads(transcripts_path.read_text()) if transcripts_path.exists() else {}
    )
    first, last = (1, args.turns // 2) if args.phase == 1 else (args.turns // 2 + 1, args.turns)
    with KVStore(store_dir, layout, model_fingerprint=loaded.fingerprint, config=config) as store:
        engine = Engine(loaded, store)
        # one throwaway request first: the first forward pass pays one-time costs (allocator, kernels)
        engine.chat("warm-up", [{"role": "user", "content": "Hello"}], max_new_tokens=2, use_cache=False)
        for turn in range(first, last + 1):
            for agent in range(args.agents):
                sid = f"agent-{agent}"
                priority = PRIORITIES[agent % len(PRIORITIES)]
                messages = transcripts.setdefault(
                    sid, [{"role": "system", "content": system_prompt(agent, args.context_chars)}]
                )
                messages.append({"role": "user", "content": QUESTIONS[(turn - 1 + agent) % len(QUESTIONS)]})
                reused = engine.chat(sid, messages, max_new_tokens=args.max_new_tokens, priority=priority)
                baseline = engine.chat(sid, messages, max_new_tokens=args.max_new_tokens, use_cache=False)
                messages.append({"role": "assistant", "content": reused.text})
                record = TurnRecord(
                    sid,
                    priority,
                    turn,
                    args.phase,
                    reused.prompt_tokens,
                    reused.cached_tokens,
                    {k: v for k, v in reused.cached_by_tier.items() if v},
                    reused.prefill_tokens,
                    round(reused.ttft_ms, 1),
                    round(baseline.ttft_ms, 1),
                    reused.token_ids == baseline.token_ids,
                    reused.text,
                    l1_codecs(store, store.session(sid)),
                )
                print(json.dumps({"turn": asdict(record)}), flush=True)
        # the transcripts are what a client would keep; written atomically like everything else
        tmp = transcripts_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(transcripts))
        tmp.replace(transcripts_path)
        if args.phase == 2:
            store.flush()
            stats = store.stats()
            sessions = [store.session(f"agent-{a}") for a in range(args.agents)]
            logical = sum(layout.block_nbytes(s.num_tokens) for s in sessions)
            tiers = {
                t.tier: {"blocks": t.blocks, "bytes": t.used_bytes, "by_codec": t.bytes_by_codec}
                for t in stats.tiers
            }
            print(
                json.dumps(
                    {
                        "store": {
                            "path": str(store_dir),
                            "logical_kv_bytes": logical,
                            "tiers": tiers,
                            "sessions_tokens": [s.num_tokens for s in sessions],
                        }
                    }
                ),
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstrata.demo", description=__doc__)
    parser.add_argument("phase", type=int, choices=[1, 2])
    parser.add_argument("store")
    parser.add_argument("--model", default=None)
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--context-chars", type=int, default=8000)
    parser.add_argument("--l1-mib", type=int, default=256)
    parser.add_argument("--l2-mib", type=int, default=256)
    parser.add_argument("--remote", default=None)
    parser.add_argument("--remote-cluster", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="No progress bars on stderr.")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    run_phase(args)
    print(json.dumps({"phase_seconds": round(time.perf_counter() - started, 1)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
