"""``kvstrata bench reopen``: how long a store holding many sessions takes to reopen (a restart).

The store (by default 1,000 sessions of 50 blocks: 50,000 blocks) is built through the public
API, as an engine would fill it: each session created, appended and checkpointed, with its own
token ids (no block is shared), on a small KV geometry so that building it is about files and
index rows, not bytes. ``--build-workers`` processes build it side by side (the store serves many
processes at once), each its share of the sessions. ``--dir`` keeps the store: a later run with
the same ``--dir`` reuses it.

Then ``KVStore(path)`` is timed in fresh processes (``--repeats``, the interpreter and imports
excluded): what a restart costs before the first request, with the default memory tiers. The
target (issue 14): under 0.2 s median at 1,000 sessions / 50,000 blocks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
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
from kvstrata.bench.common.measure import check_positive, fmt_ms, median, verdict
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import bench_config, open_store, workdir
from kvstrata.errors import ConfigError

SUITE = "reopen"
TARGET_S = 0.2
# 2 layers x 1 KV head x 8 dims in fp16, 64 tokens a block: 4 KiB of KV a block
GEOMETRY = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16", "block_tokens": 64}
_BUILD_IN_CHILD = """
import json, sys
from kvstrata.bench.reopen.runner import build_share
build_share(*json.loads(sys.argv[1]))
"""
_OPEN_IN_CHILD = """
import json, sys, time
from kvstrata import KVStore
from kvstrata.store.tiers.base import TierLevel
started = time.perf_counter()
store = KVStore(sys.argv[1])
seconds = time.perf_counter() - started
blocks = store.blocks.tier_usage()[TierLevel.L3].blocks
sessions = len(store.list_sessions())
store.close()
print(json.dumps({"seconds": seconds, "blocks": blocks, "sessions": sessions}))
"""


def command(
    sessions: Annotated[int, typer.Option(help="Sessions in the store.")] = 1000,
    blocks: Annotated[
        int, typer.Option(help="Blocks in the store, spread evenly over the sessions.")
    ] = 50_000,
    repeats: RepeatsOption = 5,
    build_workers: Annotated[int, typer.Option(help="Processes that build the store side by side.")] = 2,
    dir_: Annotated[
        Path | None,
        typer.Option("--dir", help="Keep the store here; an existing one is reused (default: a temp dir)."),
    ] = None,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Reopen a store of many sessions and blocks in fresh processes (a restart)."""
    with one_line_errors():
        result = run(
            sessions=sessions, blocks=blocks, repeats=repeats, build_workers=build_workers, root=dir_
        )
    show(result, json_out=json_out, plot=plot)


def run(
    *,
    sessions: int = 1000,
    blocks: int = 50_000,
    repeats: int = 5,
    build_workers: int = 2,
    root: Path | None = None,
    progress: bool = True,
) -> BenchResult:
    check_positive(sessions=sessions, blocks=blocks, repeats=repeats, build_workers=build_workers)
    per_session = blocks // sessions
    if per_session < 1:
        raise ConfigError(f"--blocks ({blocks}) must be at least --sessions ({sessions})")
    with workdir(root, "kvstrata-bench-reopen-") as base:
        store_dir = base / "store" if root is None else base
        built_s = None
        if not (store_dir / "index.sqlite").exists():
            built_s = build(store_dir, sessions, per_session, build_workers, progress=progress)
        opens = [open_in_child(store_dir) for _ in range(repeats)]
    found = opens[0]
    if found["sessions"] != sessions or found["blocks"] != sessions * per_session:
        raise ConfigError(
            f"the store at {store_dir} holds {found['sessions']} sessions and {found['blocks']} blocks, "
            f"not {sessions} and {sessions * per_session}: give another --dir"
        )
    seconds = [o["seconds"] for o in opens]
    data = {
        "sessions": sessions,
        "blocks": sessions * per_session,
        "geometry": GEOMETRY,
        "build_s": built_s,
        "open_s": seconds,
        "median_s": median(seconds),
        "max_s": max(seconds),
        "target_s": TARGET_S,
        "target_met": median(seconds) < TARGET_S,
    }
    table = BenchTable(
        "Reopening a store in a fresh process (KVStore(path), default memory tiers)",
        ["sessions", "blocks", "median ms", "max ms", "all runs ms", "target", "met"],
    )
    table.add_row(
        f"{sessions:,}",
        f"{sessions * per_session:,}",
        fmt_ms(data["median_s"] * 1e3),
        fmt_ms(data["max_s"] * 1e3),
        " ".join(fmt_ms(s * 1e3) for s in seconds),
        f"< {TARGET_S * 1e3:.0f} ms",
        verdict(data["median_s"], TARGET_S, at_most=True),
    )
    table.notes.append(
        "built through the public API (create_session, append, checkpoint)"
        + (f" in {built_s:.1f} s" if built_s is not None else "; reused from --dir")
    )

    def plot(fig: Any) -> None:
        ax = fig.subplots(1, 1)
        ax.bar(range(len(seconds)), [s * 1e3 for s in seconds], label="reopen")
        ax.axhline(TARGET_S * 1e3, color="red", lw=1, label="target")
        ax.set_xlabel("run")
        ax.set_ylabel("ms")
        ax.set_title(f"{sessions:,} sessions, {sessions * per_session:,} blocks", fontsize=9)
        ax.legend(fontsize=7)

    params = {"sessions": sessions, "blocks": blocks, "repeats": repeats, "build_workers": build_workers}
    return BenchResult(SUITE, params | {"dir": root}, data, [table], plot)


def build(root: Path, sessions: int, per_session: int, workers: int, *, progress: bool = True) -> float:
    """Fill a new store with ``sessions`` sessions of ``per_session`` full blocks each, by
    ``workers`` processes; the seconds it took."""
    from kvstrata.layout import KVLayout

    layout = KVLayout(**GEOMETRY)  # type: ignore[arg-type]
    with open_store(None, root, bench_config(0, 0), layout=layout):
        pass  # create it once, before the workers open it
    started = time.perf_counter()
    shares = [list(range(w, sessions, workers)) for w in range(workers)]
    with progress_bar(progress) as bar:
        task = bar.add_task("reopen: building the store", total=workers)
        # fresh interpreters, each its share of the sessions (the store serves many processes)
        children = [
            subprocess.Popen(
                [sys.executable, "-c", _BUILD_IN_CHILD, json.dumps([str(root), share, per_session])],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for share in shares
        ]
        errors = []
        for child in children:
            _, stderr = child.communicate()
            if child.returncode != 0:
                errors.append(stderr.strip().splitlines()[-1:] or [f"exit status {child.returncode}"])
            bar.advance(task)
    if errors:
        raise ConfigError(f"building the store at {root} failed: {errors[0][0]}")
    return time.perf_counter() - started


def build_share(root: str, numbers: list[int], per_session: int) -> None:
    """One builder process's sessions: ``numbers``, each ``per_session`` blocks."""
    import torch

    from kvstrata.layout import KVLayout

    layout = KVLayout(**GEOMETRY)  # type: ignore[arg-type]
    n = per_session * layout.block_tokens
    kv = torch.zeros(layout.block_shape(n), dtype=layout.torch_dtype)
    with open_store(None, Path(root), bench_config(0, 0), layout=layout) as store:
        for number in numbers:
            tokens = torch.randint(0, 49_152, (n,), generator=torch.Generator().manual_seed(number)).tolist()
            session = store.create_session(f"agent-{number:05d}")
            store.append(session, tokens, kv)
            store.checkpoint(session)


def open_in_child(root: Path) -> dict[str, Any]:
    """Open the store in a fresh Python process; its seconds, blocks and sessions."""
    out = subprocess.run(
        [sys.executable, "-c", _OPEN_IN_CHILD, str(root)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise ConfigError(f"reopening {root} failed: {out.stderr.strip().splitlines()[-1:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))
