"""Time to first token on vLLM's CPU build: kvstrata's connector against recompute and against
vLLM's built-in ExampleConnector (issue #9, acceptance 5).

Run with the vLLM virtual environment (``bash scripts/make_vllm_venv.sh`` makes it)::

    .venv-vllm/bin/python -m kvstrata.bench.vllm_connector [--repeats 5] [--layers 8 --hidden 512]

Four engines run side by side, each in its own process, on the same random-weight Llama (saved
locally; nothing is downloaded), all with vLLM's own prefix cache off so that only the connector
can skip prefill:

* ``recompute``: no connector;
* ``kvstrata``: the kvstrata connector with its default memory tiers (hits come from L1);
* ``kvstrata-L3``: the same with L1 and L2 budgets 0, so every hit is read, checksummed and decoded
  from its ``.kvbin`` file (the disk tier; the OS page cache is warm);
* ``example``: vLLM's ``ExampleConnector`` (safetensors files per layer and prompt).

Per repeat and engine, in rotating order, three requests are timed (``generate`` with
``max_tokens=1``, so the wall time is the time to first token):

* ``miss``: a new prompt nobody has seen (recompute plus the cost of saving it);
* ``repeat``: that same prompt again (a full hit for both connectors);
* ``shared-prefix``: a prefix stored during warm-up followed by a new suffix (kvstrata hits the
  prefix's blocks; ExampleConnector keys whole prompts, so it misses).

Medians (and min/max) go to stdout as a Markdown table, and all samples to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINES = ("recompute", "kvstrata", "kvstrata-L3", "example")
SCENARIOS = ("miss", "repeat", "shared-prefix")
VOCAB = (3, 259)  # byte tokens of kvstrata's tiny tokenizer


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _worker(engine: str, model: str, work: str, max_len: int, conn: Any) -> None:
    _env()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv_transfer = None
    if engine.startswith("kvstrata"):
        extra: dict[str, Any] = {"store_dir": str(Path(work) / engine)}
        if engine == "kvstrata-L3":
            extra |= {"l1_budget_bytes": 0, "l2_budget_bytes": 0}
        kv_transfer = KVTransferConfig(
            kv_connector="KVStrataConnector",
            kv_connector_module_path="kvstrata.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    elif engine == "example":
        path = Path(work) / "example"
        path.mkdir(parents=True, exist_ok=True)
        kv_transfer = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(path)},
        )
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=max_len,
        seed=0,
        kv_transfer_config=kv_transfer,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    conn.send("ready")
    while True:
        tokens = conn.recv()
        if tokens is None:
            break
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - started
        conn.send({"s": elapsed, "token": out.outputs[0].token_ids[0], "cached": out.num_cached_tokens})
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    conn.send("bye")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=3584)
    parser.add_argument("--prefix-tokens", type=int, default=3072)
    parser.add_argument("--out", type=Path, default=Path("bench-out/vllm_connector.json"))
    args = parser.parse_args()
    _env()
    from kvstrata.integrations.transformers.model import save_tiny_llama

    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    with tempfile.TemporaryDirectory(prefix="kvstrata-vllm-bench-") as work:
        os.environ["KVSTRATA_MODEL_CACHE"] = str(Path(work) / "model-cache")
        model = save_tiny_llama(
            Path(work) / "model",
            seed=3,
            num_layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
        )
        max_len = args.prompt_tokens + 64
        ctx = mp.get_context("spawn")
        workers: dict[str, tuple[Any, Any]] = {}
        for engine in ENGINES:  # one at a time: starts do not compete for the two cores
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(engine, str(model), work, max_len, child))
            proc.start()
            if parent.recv() != "ready":
                raise RuntimeError(f"engine {engine} did not start")
            workers[engine] = (parent, proc)

        def ask(engine: str, prompt: list[int]) -> dict[str, Any]:
            conn = workers[engine][0]
            conn.send(prompt)
            return conn.recv()

        prefix = tokens(args.prefix_tokens)
        for engine in ENGINES:  # warm-up: stores the shared prefix, warms every code path
            ask(engine, prefix + tokens(args.prompt_tokens - args.prefix_tokens))
            ask(engine, tokens(args.prompt_tokens))
        samples: dict[str, dict[str, list[dict[str, Any]]]] = {e: {s: [] for s in SCENARIOS} for e in ENGINES}
        first_tokens: dict[tuple[int, str], set[int]] = {}
        for rep in range(args.repeats):
            prompts = {
                "miss": tokens(args.prompt_tokens),
                "shared-prefix": prefix + tokens(args.prompt_tokens - args.prefix_tokens),
            }
            order = ENGINES[rep % len(ENGINES) :] + ENGINES[: rep % len(ENGINES)]
            for engine in order:
                for scenario in SCENARIOS:
                    prompt = prompts["miss" if scenario == "repeat" else scenario]
                    result = ask(engine, prompt)
                    samples[engine][scenario].append(result)
                    first_tokens.setdefault((rep, scenario), set()).add(result["token"])
            print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
        for conn, proc in workers.values():
            conn.send(None)
            conn.recv()
            proc.join(timeout=60)

    identical = all(len(v) == 1 for v in first_tokens.values())
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "dtype": "float32",
        },
        "prompt_tokens": args.prompt_tokens,
        "prefix_tokens": args.prefix_tokens,
        "repeats": args.repeats,
        "first_tokens_identical": identical,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(
        f"\nTTFT in ms, median (min-max) of {args.repeats}; prompt {args.prompt_tokens} tokens, shared "
        f"prefix {args.prefix_tokens}; cached = tokens vLLM did not prefill\n"
    )
    print("| engine | " + " | ".join(SCENARIOS) + " |")
    print("|---|" + "---|" * len(SCENARIOS))
    for engine in ENGINES:
        cells = []
        for scenario in SCENARIOS:
            runs = samples[engine][scenario]
            ms = [r["s"] * 1000 for r in runs]
            cached = statistics.median(r["cached"] for r in runs)
            cells.append(f"{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f}), cached {cached:.0f}")
        print(f"| {engine} | " + " | ".join(cells) + " |")
    print(f"\nfirst token identical across engines in every request: {identical}")


if __name__ == "__main__":
    main()
