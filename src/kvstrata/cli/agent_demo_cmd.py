"""``kvstrata demo``: the main job (see ``kvstrata.demo``), run as two processes with a restart.

``--store`` is a store root like every command's: the demo's store is ``<store>/<layout>/``. The
demo starts from an empty store, so it first removes the stores under the root that an earlier
demo made (they carry ``kvstrata.demo.DEMO_MARK``) and refuses a root holding any other store.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from kvstrata.cli.common import (
    JsonOption,
    ModelOption,
    RemoteClusterOption,
    RemoteOption,
    console,
    err_console,
    fail,
    print_json,
    remote_config,
)
from kvstrata.cli.progress import stderr_is_terminal
from kvstrata.cli.stores import check_writable_root, find_stores
from kvstrata.config import MiB, default_store_dir
from kvstrata.demo import DEMO_MARK, TRANSCRIPTS

# What each column of the table means, printed under it.
LEGEND = (
    ("p", "process: 1 before the restart, 2 the new process that resumed every session from disk"),
    ("agent, class", "the agent and its priority class (the precision its blocks are held in, in each tier)"),
    ("prompt", "prompt tokens of the turn"),
    ("reused", "prompt tokens whose KV came from the store (the rest were prefilled)"),
    ("from", "where the reused tokens came from: L1 device memory, L2 host memory, L3 disk, L4 Redis"),
    (
        "L1 as",
        "the agent's blocks in device memory after the turn, per codec: identity (exact: realtime, and "
        "every class's newest block), int8s (interactive), kivi4 (background); attention reads them there",
    ),
    ("ttft ms", "time to first token with kvstrata"),
    ("full ms", "time to first token recomputing the same prompt in full, in the same process"),
    ("x", "full ms / ttft ms: how many times faster the first token came"),
    (
        "same",
        "the reply is token for token the recomputed one (realtime blocks stay exact; the other "
        "classes' are 8 or 4-bit, in device memory too, which may change a token)",
    ),
)


def _run_phase(
    phase: int, store: Path, extra: list[str], quiet: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cmd = [sys.executable, "-m", "kvstrata.demo", str(phase), str(store), *extra]
    turns: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        for line in child.stdout:
            event = json.loads(line)
            if "turn" in event:
                t = event["turn"]
                turns.append(t)
                if not quiet:
                    # one line per turn, never wrapped (a log file reads it whole)
                    err_console.print(
                        f"process {phase} · {t['agent']} turn {t['turn']}: {t['prompt_tokens']} prompt "
                        f"tokens, {t['cached_tokens']} reused, TTFT {t['ttft_ms']:.0f} ms vs "
                        f"{t['recompute_ttft_ms']:.0f} ms recomputed",
                        highlight=False,
                        soft_wrap=True,
                    )
            else:
                summary.update(event)
    if child.returncode != 0:
        fail(f"demo process {phase} failed (exit {child.returncode})")
    return turns, summary


def demo(
    store: Annotated[
        Path | None,
        typer.Option(
            "--store",
            help="Store root; the demo's store is DIR/<layout>/, emptied first (default: <data dir>/demo).",
        ),
    ] = None,
    model: ModelOption = None,
    agents: Annotated[int, typer.Option(min=1, help="Number of agents.")] = 6,
    turns: Annotated[int, typer.Option(min=2, help="Turns per agent (half before the restart).")] = 4,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per turn.")] = 12,
    context_chars: Annotated[int, typer.Option(min=100, help="Characters of shared reference text.")] = 8000,
    remote: RemoteOption = None,
    remote_cluster: RemoteClusterOption = False,
    json_out: JsonOption = False,
) -> None:
    """Agents sharing a system prompt talk for several turns; the process restarts halfway.

    Every turn is timed with kvstrata and as a full recompute of the same prompt."""
    root = (store or default_store_dir().parent / "demo").expanduser()
    _remove_earlier_demo_stores(root)
    check_writable_root(root)  # before the processes load the model
    extra = [
        "--agents",
        str(agents),
        "--turns",
        str(turns),
        "--max-new-tokens",
        str(max_new_tokens),
        "--context-chars",
        str(context_chars),
    ]
    if model:
        extra += ["--model", str(model)]
    if remote:
        remote_config(remote, remote_cluster)  # validate before starting the processes
        extra += ["--remote", remote] + (["--remote-cluster"] if remote_cluster else [])
    if json_out or not stderr_is_terminal():
        extra.append("--quiet")
    records: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for phase in (1, 2):
        phase_turns, phase_summary = _run_phase(phase, root, extra, json_out)
        records += phase_turns
        summary.update(phase_summary)
    store_info = summary.get("store", {})
    l3 = store_info.get("tiers", {}).get("L3", {})
    long_turns = [r for r in records if r["prompt_tokens"] >= 2000 and r["cached_tokens"] > 0]
    speedups = [
        r["recompute_ttft_ms"] / r["ttft_ms"] for r in records if r["cached_tokens"] > 0 and r["ttft_ms"]
    ]
    result = {
        "store": store_info.get("path", str(root)),
        "turns": records,
        "median_speedup": round(statistics.median(speedups), 1) if speedups else None,
        "median_speedup_2000_plus": round(
            statistics.median(r["recompute_ttft_ms"] / r["ttft_ms"] for r in long_turns), 1
        )
        if long_turns
        else None,
        "store_bytes": store_info.get("tiers", {}),
        "logical_kv_bytes": store_info.get("logical_kv_bytes"),
        "dedup_ratio": round(store_info["logical_kv_bytes"] / l3["bytes"], 2) if l3.get("bytes") else None,
    }
    if json_out:
        print_json(result)
        return
    table = Table(
        title=f"{agents} agents, restart after turn {turns // 2}: time to first token, kvstrata vs recompute",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    columns = (
        "p",
        "agent",
        "class",
        "turn",
        "prompt",
        "reused",
        "from",
        "L1 as",
        "ttft ms",
        "full ms",
        "x",
        "same",
    )
    for col in columns:
        table.add_column(
            col, justify="left" if col in ("agent", "class", "from", "L1 as") else "right", no_wrap=True
        )
    for r in records:
        tiers = " ".join(f"{k}:{v}" for k, v in r["cached_by_tier"].items()) or "-"
        held = " ".join(f"{k}:{v}" for k, v in r.get("l1_codecs", {}).items()) or "-"
        table.add_row(
            str(r["phase"]),
            r["agent"],
            r["priority"],
            str(r["turn"]),
            str(r["prompt_tokens"]),
            str(r["cached_tokens"]),
            tiers,
            held,
            f"{r['ttft_ms']:.0f}",
            f"{r['recompute_ttft_ms']:.0f}",
            f"{r['recompute_ttft_ms'] / r['ttft_ms']:.1f}",
            "yes" if r["same_output"] else "no",
        )
    console.print(table)
    legend = Table.grid(padding=(0, 2))
    legend.add_column(style="bold", no_wrap=True)
    legend.add_column()
    for name, meaning in LEGEND:
        legend.add_row(name, meaning)
    console.print(legend)
    tiers = store_info.get("tiers", {})
    console.print(
        "store: "
        + " · ".join(f"{k} {v['blocks']} blocks {v['bytes'] / MiB:.1f} MiB" for k, v in tiers.items())
    )
    if result["dedup_ratio"]:
        console.print(
            f"the agents' KV would take {result['logical_kv_bytes'] / MiB:.1f} MiB; L3 holds "
            f"{l3['bytes'] / MiB:.1f} MiB ({result['dedup_ratio']}x smaller: the shared prompt is stored "
            "once, lossy classes are compressed)"
        )
    console.print(
        f"median TTFT speedup over full recompute: {result['median_speedup']}x"
        + (
            f" ({result['median_speedup_2000_plus']}x for prompts of 2,000+ tokens)"
            if result["median_speedup_2000_plus"]
            else ""
        )
    )


def _remove_earlier_demo_stores(root: Path) -> None:
    """Empty the demo's stores under ``root`` (the demo starts from nothing); refuse any other store."""
    stores = find_stores(root)
    foreign = [path for path in stores if not ((path / DEMO_MARK).exists() or (path / TRANSCRIPTS).exists())]
    if foreign:
        fail(
            f"{root} holds a store that kvstrata demo did not make ({', '.join(map(str, foreign))}); "
            "the demo starts from an empty store: give it another --store"
        )
    for path in stores:
        shutil.rmtree(path)
