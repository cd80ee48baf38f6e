"""Time to first token of vLLM's OpenAI server on its CPU build, with kvstrata's connector against
vLLM without it (issue #15, acceptance 8).

Run with the vLLM virtual environment (``bash scripts/make_vllm_venv.sh`` makes it)::

    .venv-vllm/bin/python -m kvstrata.bench.vllm_connector [--repeats 5] [--layers 8 --hidden 512]
    .venv-vllm/bin/python -m kvstrata.bench.vllm_connector --dtype bfloat16 --kv-cache-dtype fp8

Servers run side by side, each started the documented way (``python -m
vllm.entrypoints.openai.api_server``, vLLM's default multi-process mode: the scheduler in the
EngineCore process, the model in a worker process), on the same random-weight Llama (saved
locally; nothing is downloaded), all with vLLM's own prefix cache off so that only the connector
can skip prefill:

* ``recompute``: no connector;
* ``kvstrata``: the connector with its default memory tiers (the worker keeps recent blocks in L1/L2);
* ``kvstrata-L3``: the same with L1 and L2 budgets 0, so every hit is read, checksummed and decoded
  from its ``.kvbin`` file;
* optional (``--engines``): ``kvstrata-sync`` (``load_async: false``) and ``example`` (vLLM's
  ``ExampleConnector``).

Per repeat, in rotating engine order, requests with ``max_tokens=1`` (the wall time of one
completion through the openai client is the time to first token):

* a pause of 1.5 s, for the previous engine's worker to stop spinning (vLLM's shared-memory
  queue reader busy-loops for a second after its last message), then a short request, not timed:
  an engine that sat idle while the others ran is slower on its first request, whatever it is;
* ``miss``: a new prompt nobody has seen (recompute, plus the connector's lookup and saving it);
* ``repeat``: that same prompt again (a full hit);
* ``shared-prefix``: a prefix stored during warm-up followed by a new suffix;
* ``cold-disk`` (kvstrata-L3 and recompute): the previous repeat's ``miss`` prompt, after the
  store's block files were dropped from the OS page cache (``posix_fadvise(DONTNEED)``).

After each request the benchmark waits until the connector's saves of it reached the disk tier, so
one request's background saves never run into the next one's timing (the machine has few cores).
Medians (and min/max) go to stdout as a Markdown table, all samples to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ENGINES = ("recompute", "kvstrata", "kvstrata-L3")
OPTIONAL_ENGINES = ("kvstrata-sync", "example")
SCENARIOS = ("miss", "repeat", "shared-prefix", "cold-disk")
COLD_ENGINES = ("recompute", "kvstrata-L3")
VOCAB = (3, 259)  # byte tokens of kvstrata's tiny tokenizer
BLOCK = 128  # vLLM's block size on the CPU backend
MODEL_NAME = "bench"
IDLE_S = 1.5  # vLLM's worker stops spinning 1 s after its last request (``SpinCondition.busy_loop_s``)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Engine:
    """One vLLM server process group."""

    def __init__(self, name: str, model: Path, work: Path, max_len: int, dtypes: tuple[str, str]) -> None:
        self.name = name
        self.root = work / name if name.startswith("kvstrata") else None
        self.port = _free_port()
        self.log = work / f"{name}.log"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(max_len), "--enforce-eager", "--dtype", dtypes[0], "--seed", "0",
            "--kv-cache-dtype", dtypes[1],
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        ]  # fmt: skip
        config: dict[str, Any] | None = None
        if self.root is not None:
            extra: dict[str, Any] = {"store_dir": str(self.root)}
            if name == "kvstrata-L3":
                extra |= {"l1_budget_bytes": 0, "l2_budget_bytes": 0}
            if name == "kvstrata-sync":
                extra["load_async"] = False
            config = {
                "kv_connector": "KVStrataConnector",
                "kv_connector_module_path": "kvstrata.integrations.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        elif name == "example":
            path = work / "example"
            path.mkdir(parents=True, exist_ok=True)
            config = {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(path)},
            }
        if config is not None:
            cmd += ["--kv-transfer-config", json.dumps(config)]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"})
        # vLLM's CPU platform keeps cores free of its worker's threads: one per worker, and one more
        # when any KV connector is configured (meant for NIXL). On a small machine that would give
        # the engines different thread counts; every engine gets the same reservation instead.
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                cmd, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._client: Any = None

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(1)

    def ask(self, tokens: list[int]) -> dict[str, Any]:
        from openai import OpenAI

        if self._client is None:
            self._client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="-", max_retries=0)
        started = time.perf_counter()
        out = self._client.completions.create(
            model=MODEL_NAME,
            prompt=tokens,
            max_tokens=1,
            temperature=0.0,
            extra_body={"return_token_ids": True},
        )
        elapsed = time.perf_counter() - started
        details = out.usage.prompt_tokens_details if out.usage is not None else None
        return {
            "s": elapsed,
            "token": out.choices[0].token_ids[0],  # type: ignore[attr-defined]
            "cached": int(getattr(details, "cached_tokens", 0) or 0),
        }

    def stop(self) -> None:
        import signal

        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class StoreProbe:
    """Asks a connector's store (read-only, beside the server) whether a prompt's blocks are on
    disk, and drops its files from the page cache."""

    def __init__(self, root: Path, model: Path, layout: Any) -> None:
        from kvstrata.integrations.transformers.model import fingerprint_model_dir

        self.root = root
        self.layout = layout
        self.fingerprint = fingerprint_model_dir(model)

    def _path(self) -> Path:
        from kvstrata.cli.stores import store_for_layout

        return store_for_layout(self.root, self.layout)

    def keys(self, tokens: list[int]) -> list[bytes]:
        from kvstrata.keys import chain_keys, root_key

        return chain_keys(root_key(self.fingerprint, self.layout, "default"), tokens, BLOCK)

    def wait_saved(self, tokens: list[int], timeout: float = 120) -> None:
        from kvstrata.config import StoreConfig
        from kvstrata.store import KVStore

        keys = self.keys(tokens)[: len(tokens) // BLOCK]  # max_tokens=1: no decode block
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self._path() / "index.sqlite").exists():
                config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)
                with KVStore(self._path(), read_only=True, config=config) as store:
                    if all(store.blocks.contains(k) for k in keys):  # type: ignore[arg-type]
                        return
            time.sleep(0.1)
        raise RuntimeError(f"the saves of a prompt did not reach {self._path()} in {timeout:.0f} s")

    def drop_page_cache(self) -> int:
        dropped = 0
        for path in self._path().rglob("*.kv*"):
            if path.suffix not in (".kvbin", ".kvseg"):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            finally:
                os.close(fd)
        return dropped


def _table(samples: dict[str, dict[str, list[dict[str, Any]]]], engines: list[str]) -> list[str]:
    lines = ["| engine | " + " | ".join(SCENARIOS) + " |", "|---|" + "---|" * len(SCENARIOS)]
    for engine in engines:
        cells = []
        for scenario in SCENARIOS:
            runs = samples[engine][scenario]
            if not runs:
                cells.append("-")
                continue
            ms = [r["s"] * 1000 for r in runs]
            cached = statistics.median(r["cached"] for r in runs)
            cells.append(f"{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f}), cached {cached:.0f}")
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    return lines


def _ratios(samples: dict[str, dict[str, list[dict[str, Any]]]], engines: list[str]) -> dict[str, float]:
    """Median TTFT of each (engine, scenario) over recompute's median of the same scenario."""
    out = {}
    for engine in engines:
        for scenario in SCENARIOS:
            base = samples["recompute"][scenario]
            runs = samples[engine][scenario]
            if engine != "recompute" and base and runs:
                base_ms = statistics.median(r["s"] for r in base)
                out[f"{engine}/{scenario}"] = statistics.median(r["s"] for r in runs) / base_ms
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=3584)
    parser.add_argument("--prefix-tokens", type=int, default=3072)
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated, from {', '.join(ENGINES + OPTIONAL_ENGINES)} (recompute is always run)",
    )
    parser.add_argument("--dtype", default="float32", help="the model's (bfloat16 for an fp8 cache)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's: auto, fp8, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--out", type=Path, default=Path("bench-out/vllm_connector.json"))
    args = parser.parse_args()
    engines = ["recompute"] + [e for e in args.engines.split(",") if e and e != "recompute"]
    unknown = set(engines) - set(ENGINES + OPTIONAL_ENGINES)
    if unknown:
        parser.error(f"unknown engines: {', '.join(sorted(unknown))}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from kvstrata.integrations.transformers.model import save_tiny_llama
    from kvstrata.integrations.vllm.layout import FP8_CACHES  # the kv_cache_dtype names vLLM takes
    from kvstrata.layout import KVLayout, dtype_name

    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvstrata-vllm-bench-") as tmp:
        work = Path(tmp)
        os.environ["KVSTRATA_MODEL_CACHE"] = str(work / "model-cache")
        model = save_tiny_llama(
            work / "model", seed=3, num_layers=args.layers, hidden=args.hidden, heads=args.heads,
            kv_heads=args.kv_heads,
        )  # fmt: skip
        fp8 = FP8_CACHES.get(args.kv_cache_dtype)
        layout = KVLayout(
            num_layers=args.layers,
            num_kv_heads=args.kv_heads,
            head_dim=args.hidden // args.heads,
            dtype=dtype_name(fp8) if fp8 is not None else args.dtype,
            block_tokens=BLOCK,
        )
        running: dict[str, Engine] = {}
        try:
            for name in engines:  # one at a time: starts do not compete for the cores
                dtypes = (args.dtype, args.kv_cache_dtype)
                running[name] = Engine(name, model, work, args.prompt_tokens + 64, dtypes)
                running[name].wait_ready()
                print(f"engine {name} ready", flush=True)
            probes = {
                name: StoreProbe(engine.root, model, layout)
                for name, engine in running.items()
                if engine.root is not None
            }

            def ask(name: str, prompt: list[int]) -> dict[str, Any]:
                result = running[name].ask(prompt)
                if name in probes:
                    probes[name].wait_saved(prompt)
                return result

            prefix = tokens(args.prefix_tokens)
            for name in engines:  # warm-up: stores the shared prefix, warms every code path
                ask(name, prefix + tokens(args.prompt_tokens - args.prefix_tokens))
                warm = tokens(args.prompt_tokens)
                ask(name, warm)
                ask(name, warm)
            samples: dict[str, dict[str, list[dict[str, Any]]]] = {
                e: {s: [] for s in SCENARIOS} for e in engines
            }
            first_tokens: dict[tuple[int, str], set[int]] = {}
            previous_miss: list[int] | None = None
            for rep in range(args.repeats):
                prompts = {
                    "miss": tokens(args.prompt_tokens),
                    "shared-prefix": prefix + tokens(args.prompt_tokens - args.prefix_tokens),
                }
                order = engines[rep % len(engines) :] + engines[: rep % len(engines)]
                for name in order:
                    # the engine before keeps its worker busy: vLLM's shared-memory queue reader
                    # spins for a second after its last message (sched_yield; 1.0 s of CPU in the
                    # 3 s after any request, measured), which took a core from the next engine's
                    # timed requests on two cores (fp8 misses 0.97x-1.53x from run to run)
                    time.sleep(IDLE_S)
                    # an engine that sat idle while the others ran answers its first request
                    # slower (caches, the others' background work): a short one, not timed
                    ask(name, tokens(16))
                    for scenario in SCENARIOS:
                        if scenario == "cold-disk":
                            if previous_miss is None or name not in COLD_ENGINES:
                                continue
                            if name in probes:
                                probes[name].drop_page_cache()
                            prompt = previous_miss
                        else:
                            prompt = prompts["miss" if scenario == "repeat" else scenario]
                        result = ask(name, prompt)
                        samples[name][scenario].append(result)
                        first_tokens.setdefault((rep, scenario), set()).add(result["token"])
                previous_miss = prompts["miss"]
                print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
        finally:
            for engine in running.values():
                engine.stop()

    identical = all(len(v) == 1 for v in first_tokens.values())
    ratios = _ratios(samples, engines)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_at_start": load,
        "load_average_at_end": os.getloadavg(),
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "dtype": args.dtype,
            "kv_cache_dtype": args.kv_cache_dtype,
        },
        "prompt_tokens": args.prompt_tokens,
        "prefix_tokens": args.prefix_tokens,
        "repeats": args.repeats,
        "first_tokens_identical": identical,
        "ratios_to_recompute": ratios,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(
        f"\nTTFT in ms through vLLM's OpenAI server, median (min-max) of {args.repeats}; prompt "
        f"{args.prompt_tokens} tokens, shared prefix {args.prefix_tokens}; model {args.dtype}, KV cache "
        f"{args.kv_cache_dtype}; cached = tokens vLLM did "
        f"not prefill; load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end\n"
    )
    print("\n".join(_table(samples, engines)))
    print("\nmedian TTFT / recompute's: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(f"first token identical across engines in every request: {identical}")


if __name__ == "__main__":
    main()
