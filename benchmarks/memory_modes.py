"""Lossy memory modes at run time: a long background session resumed with all of its history,
with ``window:BUDGET`` and with ``importance:BUDGET`` (issue 5), measured alternately in one run.

One background session is built once (a system prompt holding ``--context-chars`` of
public-domain text, one turn; importance tracked while it is prefilled). Each trial forks it once
per mode (forks share the blocks, and so their importance) and runs the next turn on the fork:
time to first token, tokens attended, decode speed, and how many leading greedy tokens equal
the full-history answer of the same trial. The store is in memory (L1/L2): this measures the compute
and memory a pruned context saves, not loading.

    python benchmarks/memory_modes.py [--model PATH] [--context-chars 16000] [--budget 1024]
                                      [--trials 3] [--decode 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from kvstrata import KVStore, StoreConfig
from kvstrata.demo import shared_context
from kvstrata.engine import Engine
from kvstrata.integrations.transformers.model import load_model
from kvstrata.policy.ladder import CodecLadder
from kvstrata.policy.memory import MemoryMode


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--context-chars", type=int, default=16000)
    parser.add_argument("--budget", type=int, default=1024, help="tokens kept by the lossy modes")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--decode", type=int, default=32)
    args = parser.parse_args()
    model = load_model(args.model)
    messages = [
        {
            "role": "system",
            "content": f"You are a background analyst. Reference:\n{shared_context(args.context_chars)}",
        },
        {"role": "user", "content": "Who was sold into Egypt, and by whom?"},
    ]
    modes = {
        "full": None,
        f"window:{args.budget}": MemoryMode("window", args.budget),
        f"importance:{args.budget}": MemoryMode("importance", args.budget),
    }
    with tempfile.TemporaryDirectory(prefix="kvstrata-memory-modes-") as work:
        config = StoreConfig(ladder=CodecLadder.exact(), l1_budget_bytes=2 << 30, l2_budget_bytes=2 << 30)
        with KVStore(
            Path(work) / "store", model.layout(), model_fingerprint=model.fingerprint, config=config
        ) as store:
            builder = Engine(model, store, track_importance=True)
            first = builder.chat("bg", messages, max_new_tokens=16, priority="background")
            messages += [
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": "And what did his brothers do next? Answer in two sentences."},
            ]
            engines = {
                name: Engine(
                    model,
                    store,
                    memory_modes={"background": mode} if mode else None,
                    track_importance=mode is not None and mode.kind == "importance",
                    l1_resident_sessions=64,
                )
                for name, mode in modes.items()
            }
            rows: dict[str, dict[str, list[float]]] = {
                name: {"ttft_ms": [], "decode_tok_s": [], "attended": [], "agree": []} for name in modes
            }
            history = store.session("bg").num_tokens
            for trial in range(args.trials):
                order = list(modes) if trial % 2 == 0 else list(reversed(modes))
                answers = {}
                for name in order:
                    fork = store.fork(store.session("bg"), f"bg-{trial}-{name}")
                    reply = engines[name].chat(
                        fork.id, messages, max_new_tokens=args.decode, priority="background"
                    )
                    answers[name] = reply.token_ids
                    rows[name]["ttft_ms"].append(reply.ttft_ms)
                    rows[name]["decode_tok_s"].append(reply.decode_tokens_per_s)
                    rows[name]["attended"].append(reply.attended_tokens or reply.cached_tokens)
                for name in modes:
                    same = next(
                        (
                            i
                            for i, (a, b) in enumerate(zip(answers[name], answers["full"], strict=False))
                            if a != b
                        ),
                        min(len(answers[name]), len(answers["full"])),
                    )
                    rows[name]["agree"].append(same / max(1, len(answers["full"])))
            for engine in engines.values():
                engine.close()
            builder.close()
    summary = {
        "history_tokens": history,
        "budget_tokens": args.budget,
        "modes": {
            name: {key: round(statistics.median(values), 3) for key, values in row.items()}
            for name, row in rows.items()
        },
    }
    full_ttft = summary["modes"]["full"]["ttft_ms"]
    for stats in summary["modes"].values():
        stats["ttft_vs_full"] = round(stats["ttft_ms"] / full_ttft, 3)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
