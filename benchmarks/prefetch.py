"""Prefetch: agent B is hinted while agent A decodes; B's time to first token with and without
the hint, measured alternately in one run (issue 5, point 3).

A template store holds two sessions of about 1,500 tokens (A interactive, B background, default
codec ladder, so B's older blocks are KIVI-4 on disk). Each trial copies the template (a restart:
memory tiers empty), drops the block files from the page cache (a cold L3), runs one turn of A
(``--decode`` new tokens) and then one turn of B. With prefetch, ``engine.hint(next=["b"])`` is
called just before A's turn, so B's blocks are read, decoded and placed in L1 while A computes.

    python benchmarks/prefetch.py [--model PATH] [--trials 3] [--decode 24]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from kvstrata import KVStore
from kvstrata.demo import shared_context
from kvstrata.engine import Engine
from kvstrata.integrations.transformers.model import load_model


def drop_page_cache(root: Path) -> None:
    for path in root.rglob("*.kvbin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped: write the copy back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def conversation(name: str, text: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You are agent {name}. Reference:\n{text}"},
        {"role": "user", "content": f"Agent {name}, summarize the reference in one sentence."},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--decode", type=int, default=24)
    args = parser.parse_args()
    model = load_model(args.model, attn_implementation="sdpa")
    text = shared_context(6000)
    work = Path(tempfile.mkdtemp(prefix="kvstrata-prefetch-"))
    template = work / "template"
    messages = {name: conversation(name, text[i * 2000 :] + text[: i * 2000]) for i, name in enumerate("ab")}
    with KVStore(template, model.layout(), model_fingerprint=model.fingerprint) as store:
        engine = Engine(model, store)
        replies = {
            name: engine.chat(
                name,
                messages[name],
                max_new_tokens=8,
                priority="interactive" if name == "a" else "background",
            )
            for name in "ab"
        }
        store.flush()
    for name in "ab":
        messages[name] += [
            {"role": "assistant", "content": replies[name].text},
            {"role": "user", "content": "Now in five words."},
        ]
    results: dict[str, list[float]] = {"with_prefetch": [], "without": []}
    for trial in range(args.trials):
        for mode in ("with_prefetch", "without") if trial % 2 == 0 else ("without", "with_prefetch"):
            root = work / f"trial-{trial}-{mode}"
            shutil.copytree(template, root)
            drop_page_cache(root)
            with KVStore(root, model.layout(), model_fingerprint=model.fingerprint) as store:
                engine = Engine(model, store)
                if mode == "with_prefetch":
                    engine.hint(next=["b"])
                engine.chat("a", messages["a"], max_new_tokens=args.decode, priority="interactive")
                b = engine.chat("b", messages["b"], max_new_tokens=4, priority="background")
                results[mode].append(b.ttft_ms)
                engine.close()
    shutil.rmtree(work, ignore_errors=True)
    summary = {
        mode: {"ttft_ms": [round(t, 1) for t in ts], "median_ms": round(statistics.median(ts), 1)}
        for mode, ts in results.items()
    }
    summary["speedup"] = round(summary["without"]["median_ms"] / summary["with_prefetch"]["median_ms"], 2)
    summary["prompt_tokens_b"] = b.prompt_tokens
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
