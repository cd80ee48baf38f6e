"""``kvstrata bench gpu-restore``: kvstrata's restore into GPU memory against a plain pinned
``cudaMemcpy`` of the same bytes. Prepared to run unchanged on a machine with a CUDA GPU; on one
without, it says so in one line and exits 0.

For each context length, a session's KV (random values in a model's KV geometry: by default
Llama-3.1-8B's, 128 KiB of fp16 KV a token, 4.3 GB at 32,768 tokens) is committed into a store,
which is then opened with ``StoreConfig(device="cuda", pin_host_memory=True)``: L1 in device
memory, L2 a pinned host arena. Each repeat, in an order that rotates:

- ``L2 -> L1``: the blocks are in L2 (demoted there from L1 before each request, untimed);
  ``store.load`` into a device buffer (the previous request's) promotes them into L1 and copies
  them into the buffer;
- ``L3 -> L1``: a store with L1 on the device and no L2, the blocks out of L1 and the data files
  dropped from the page cache before each request; ``store.load`` reads, verifies and decodes
  each block and places it in device memory;
- ``pinned memcpy``: the same bytes from a pinned host buffer into a device buffer,
  ``copy_(non_blocking=True)``: the PCIe's rate, kvstrata's ceiling for L2 -> L1;
- ``cold read``: one file of the same size, read sequentially from a cold page cache (the disk's
  rate; L3 -> L1 is bounded by the slower of the disk and PCIe).

Times come from CUDA events around each step (recorded after a device-wide synchronize, so that
copies kvstrata issues on side streams count); GB/s are the KV bytes over that time. The same
code runs on the CPU (``run(device="cpu")``, tests), timed by the clock.
"""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from kvstrata.bench.common.command import (
    JsonOutOption,
    PlotOption,
    RepeatsOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.common.hardware import cold_sequential_read_s, drop_store_page_cache, write_baseline_file
from kvstrata.bench.common.measure import fmt_gbps, fmt_ms, fmt_x, gbps, median, parse_int_list, ratio, rotate
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import (
    Restored,
    Restorer,
    bench_config,
    commit_session,
    open_store,
    room_for,
    workdir,
)
from kvstrata.errors import ConfigError

SUITE = "gpu-restore"
GEOMETRIES = {
    "llama-3.1-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"},
    "smollm2-135m": {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "float16"},
}
L2_L1, L3_L1, PINNED, COLD_READ = "L2 -> L1", "L3 -> L1", "pinned memcpy", "cold read"
VARIANTS = (L2_L1, L3_L1, PINNED, COLD_READ)
NO_CUDA = (
    "kvstrata bench gpu-restore: no CUDA device here (torch.cuda.is_available() is False); nothing to measure"
)


def command(
    contexts: Annotated[
        str, typer.Option(help="Context lengths in tokens (comma-separated).")
    ] = "4096,16384,32768",
    geometry: Annotated[str, typer.Option(help=f"KV geometry: {', '.join(GEOMETRIES)}.")] = "llama-3.1-8b",
    repeats: RepeatsOption = 5,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """L2->L1 and L3->L1 restore into GPU memory against a pinned cudaMemcpy of the same bytes."""
    import torch

    if not torch.cuda.is_available():
        typer.echo(NO_CUDA, err=True)
        raise typer.Exit(0)
    with one_line_errors():
        result = run(contexts=parse_int_list(contexts, "--contexts"), geometry=geometry, repeats=repeats)
    show(result, json_out=json_out, plot=plot)


def run(
    *,
    contexts: list[int] | None = None,
    geometry: str = "llama-3.1-8b",
    repeats: int = 5,
    device: str = "cuda",
    block_tokens: int = 64,
    progress: bool = True,
) -> BenchResult:
    from kvstrata.layout import KVLayout

    if geometry not in GEOMETRIES:
        raise ConfigError(f"--geometry must be one of {', '.join(GEOMETRIES)}, got {geometry!r}")
    if repeats < 1:
        raise ConfigError("repeats must be >= 1")
    lengths = sorted(set(contexts or [4096, 16384, 32768]))
    layout = KVLayout(**GEOMETRIES[geometry], block_tokens=block_tokens)  # type: ignore[arg-type]
    clock = _Clock(device)
    per_context: dict[str, Any] = {}
    with workdir(None, "kvstrata-bench-gpu-restore-") as work, progress_bar(progress) as bar:
        task = bar.add_task(SUITE, total=len(lengths) * (1 + repeats * len(VARIANTS)))
        for n in lengths:
            bar.update(task, description=f"{SUITE}: committing {n} tokens")
            per_context[str(n)] = _measure(layout, n, repeats, device, clock, work / f"ctx-{n}", bar, task)
    data = {"device": clock.name, "geometry": geometry, "layout": layout.describe(), "contexts": per_context}
    params = {"contexts": lengths, "geometry": geometry, "repeats": repeats, "device": device}
    return BenchResult(SUITE, params, data, _tables(data), plot=lambda fig: _plot(fig, data))


class _Clock:
    """Seconds of a step: CUDA events on a GPU (after a device-wide synchronize), else the clock."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise ConfigError(NO_CUDA)
        self.name = torch.cuda.get_device_name(device) if self.cuda else "cpu"

    def time(self, step: Callable[[], Any]) -> float:
        import torch

        if not self.cuda:
            started = time.perf_counter()
            step()
            return time.perf_counter() - started
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        torch.cuda.synchronize()  # copies on side streams count too
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


def _measure(
    layout: Any, n: int, repeats: int, device: str, clock: _Clock, root: Path, bar: Any, task: Any
) -> dict[str, Any]:
    import numpy as np
    import torch

    cuda = clock.cuda
    kv = torch.randn(layout.block_shape(n), generator=torch.Generator().manual_seed(n)).to(layout.torch_dtype)
    nbytes = kv.numel() * kv.element_size()
    tokens = torch.randint(0, 32_000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    with open_store(None, root / "store", bench_config(0, 0), layout=layout) as store:
        commit_session(store, tokens, kv)
    bar.advance(task)
    room = room_for(nbytes)
    memory = open_store(
        None, root / "store", bench_config(room, room, device=device, pin_host_memory=cuda), layout=layout
    )
    # L1 on the device but no L2: a block leaving L1 is dropped (L3 holds it), so each request reads L3
    cold = open_store(
        None, root / "store", bench_config(room, 0, device=device), layout=layout, read_only=True
    )
    spare: list[Any] = [torch.empty(layout.block_shape(n), dtype=layout.torch_dtype, device=device)]
    restorers = {
        L2_L1: Restorer(memory, spare=spare, extra_tokens=0),
        L3_L1: Restorer(cold, spare=spare, extra_tokens=0),
    }
    pinned = kv.reshape(-1).view(torch.uint8).pin_memory() if cuda else kv.reshape(-1).view(torch.uint8)
    on_device = torch.empty_like(pinned, device=device)
    on_device.copy_(pinned)  # first touch, outside the timings
    baseline = write_baseline_file(root / "baseline.bin", nbytes)
    read_buffer = np.ones(nbytes, dtype=np.uint8)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    checks: dict[str, Any] = {}
    keys = memory.session_keys("resumed") or ([], None)
    try:
        memory.load(memory.session("resumed"))  # into L1 once, from L3
        for repeat in range(repeats):
            for variant in rotate(list(VARIANTS), repeat):
                bar.update(task, description=f"{SUITE}: {n} tokens, repeat {repeat + 1}/{repeats}, {variant}")
                gc.collect()
                if variant in restorers:  # untimed: the blocks leave device memory (for L2, or for good)
                    store = memory if variant == L2_L1 else cold
                    store.blocks.demote_from_l1(keys[0])
                    store.blocks.wait_demotions()
                if variant == L3_L1:
                    drop_store_page_cache(root / "store")
                if variant in restorers:
                    seconds, timed = _timed_restore(clock, restorers[variant])
                    samples[variant].append(seconds)
                    restored = timed.loaded
                    if variant not in checks:
                        checks[variant] = {
                            "served_by": {
                                level.name: count for level, count in restored.tokens_by_tier.items()
                            },
                            "on_device": str(restored.kv.device) if restored.kv is not None else None,
                            "bit_exact": bool(restored.kv is not None and torch.equal(restored.kv.cpu(), kv)),
                        }
                    restorers[variant].recycle(timed)
                elif variant == PINNED:
                    samples[variant].append(clock.time(lambda: on_device.copy_(pinned, non_blocking=True)))
                else:
                    samples[variant].append(cold_sequential_read_s(baseline, read_buffer))
                bar.advance(task)
    finally:
        memory.close()
        cold.close()
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"tokens": n, "kv_bytes": nbytes, "variants": {}}
    for variant, values in samples.items():
        entry = {"seconds": values, "median_s": median(values), "gbps": gbps(nbytes, median(values))}
        out["variants"][variant] = entry | checks.get(variant, {})
    v = out["variants"]
    out["ratios"] = {
        "l2_l1_vs_pinned": ratio(v[L2_L1]["gbps"], v[PINNED]["gbps"]),
        "l3_l1_vs_pinned": ratio(v[L3_L1]["gbps"], v[PINNED]["gbps"]),
        "l3_l1_vs_slower_of_disk_and_pcie": ratio(
            v[L3_L1]["gbps"], min(v[PINNED]["gbps"], v[COLD_READ]["gbps"])
        ),
    }
    return out


def _timed_restore(clock: _Clock, restorer: Restorer) -> tuple[float, Restored]:
    box: list[Restored] = []
    seconds = clock.time(lambda: box.append(restorer.restore(build_cache=False)))
    return seconds, box[0]


def _tables(data: dict[str, Any]) -> list[BenchTable]:
    table = BenchTable(
        f"Restore into {data['device']} memory ({data['geometry']} KV geometry; GB/s, median)",
        [
            "context",
            "KV MB",
            *VARIANTS,
            "L2->L1 / pinned",
            "L3->L1 / min(disk, pinned)",
            "served by",
            "lands on",
            "exact",
        ],
    )
    for key, ctx in data["contexts"].items():
        v = ctx["variants"]
        served = ", ".join("+".join(v[p].get("served_by", {})) for p in (L2_L1, L3_L1))
        lands = ", ".join(sorted({str(v[p].get("on_device")) for p in (L2_L1, L3_L1)}))
        table.add_row(
            key,
            f"{ctx['kv_bytes'] / 1e6:,.0f}",
            *(f"{fmt_gbps(v[p]['gbps'])} ({fmt_ms(v[p]['median_s'] * 1e3)} ms)" for p in VARIANTS),
            fmt_x(ctx["ratios"]["l2_l1_vs_pinned"]),
            fmt_x(ctx["ratios"]["l3_l1_vs_slower_of_disk_and_pcie"]),
            served,
            lands,
            "yes" if all(v[p].get("bit_exact") for p in (L2_L1, L3_L1)) else "NO",
        )
    table.notes.append(
        "L2 -> L1: store.load of blocks in the pinned host arena (promoted into device memory); L3 -> L1: "
        "from a cold page cache; pinned memcpy: copy_(non_blocking=True) of the same bytes"
    )
    return [table]


def _plot(fig: Any, data: dict[str, Any]) -> None:
    import numpy as np

    contexts = list(data["contexts"])
    ax = fig.subplots(1, 1)
    positions = np.arange(len(contexts))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        ys = [data["contexts"][c]["variants"][variant]["gbps"] for c in contexts]
        ax.bar(positions + i * width, ys, width, label=variant)
    ax.set_xticks(positions + width * (len(VARIANTS) - 1) / 2, contexts)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"restore into {data['device']} memory", fontsize=9)
    ax.legend(fontsize=7)
