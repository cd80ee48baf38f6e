"""A burst of background wake-ups must not delay a realtime agent (issue 5, point 4).

Ten background agents (sessions of ~700 tokens each, their older blocks KIVI-4 on a cold disk)
wake up at once: ``engine.hint`` queues their KV for loading and decompression. At the same
moment a realtime agent (its ~1,500-token session in device memory) takes a turn. Its time to
first token is compared, in one run and alternating, with the same turn with no burst. Background
loading is paced by the prefetcher's byte budget (``--budget-mbps``) and runs in one thread.

    python benchmarks/burst.py [--model PATH] [--trials 3] [--budget-mbps 256]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvstrata import KVStore
from kvstrata.demo import shared_context
from kvstrata.engine import Engine
from kvstrata.engine.prefetch import Prefetcher
from kvstrata.integrations.transformers.model import load_model
from prefetch import conversation, drop_page_cache

BACKGROUND = [f"bg-{i}" for i in range(10)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--budget-mbps", type=float, default=256.0)
    args = parser.parse_args()
    model = load_model(args.model, attn_implementation="sdpa")
    text = shared_context(8000)
    work = Path(tempfile.mkdtemp(prefix="kvstrata-burst-"))
    template = work / "template"
    rt_messages = conversation("rt", text[:6000])
    bg_messages = {sid: conversation(sid, text[300 * i : 300 * i + 2800]) for i, sid in enumerate(BACKGROUND)}
    with KVStore(template, model.layout(), model_fingerprint=model.fingerprint) as store:
        engine = Engine(model, store)
        first = engine.chat("rt", rt_messages, max_new_tokens=6, priority="realtime")
        for sid, messages in bg_messages.items():
            engine.chat(sid, messages, max_new_tokens=2, priority="background")
        store.flush()
    rt_messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Go on."}]
    results: dict[str, list[float]] = {"unloaded": [], "burst": []}
    for trial in range(args.trials):
        for mode in ("unloaded", "burst") if trial % 2 == 0 else ("burst", "unloaded"):
            root = work / f"trial-{trial}-{mode}"
            shutil.copytree(template, root)
            drop_page_cache(root)
            with KVStore(root, model.layout(), model_fingerprint=model.fingerprint) as store:
                engine = Engine(model, store, l1_resident_sessions=16)
                engine._prefetcher = Prefetcher(store, background_bytes_per_s=args.budget_mbps * 1e6)
                store.load(store.session("rt"))  # the realtime agent's KV is resident, as it runs
                if mode == "burst":
                    engine.hint(next=BACKGROUND)  # ten background agents wake up at once
                reply = engine.chat("rt", rt_messages, max_new_tokens=4, priority="realtime")
                results[mode].append(reply.ttft_ms)
                engine.close()
    shutil.rmtree(work, ignore_errors=True)
    unloaded = statistics.median(results["unloaded"])
    burst = statistics.median(results["burst"])
    print(
        json.dumps(
            {
                "unloaded_ttft_ms": [round(t, 1) for t in results["unloaded"]],
                "burst_ttft_ms": [round(t, 1) for t in results["burst"]],
                "median_unloaded_ms": round(unloaded, 1),
                "median_burst_ms": round(burst, 1),
                "ratio": round(burst / unloaded, 2),
                "budget_mbps": args.budget_mbps,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
