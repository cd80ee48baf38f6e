"""``kvstrata store demo``: the store on its own (agents sharing a prefix, a restart, a verify).

It uses the SmolLM2-135M geometry with deterministic synthetic KV, so it runs without a model:
several agents share a system prompt and append turns; the store is closed and reopened (as a
restarted process would), and every session is read back and compared bit for bit. With
``--store DIR`` the store is ``DIR/<layout>/`` like every command's (``kvstrata.cli.stores``), so
``kvstrata sessions list --store DIR`` finds it.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import typer
from rich.table import Table

from kvstrata.cli.common import JsonOption, console, print_json
from kvstrata.cli.progress import progress_bar
from kvstrata.cli.stores import check_writable_root, store_for_layout
from kvstrata.config import MiB, StoreConfig
from kvstrata.layout import KVLayout
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store import KVStore

SMOLLM2_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16", block_tokens=64)


def synthetic_kv(layout: KVLayout, token_ids: list[int], start_pos: int) -> torch.Tensor:
    """KV that depends only on (token, position): what a real model's prefix KV also satisfies."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(layout.block_shape(1), generator=gen)
    tok = torch.tensor(token_ids, dtype=torch.float32).view(1, 1, 1, -1, 1)
    pos = torch.arange(start_pos, start_pos + len(token_ids), dtype=torch.float32).view(1, 1, 1, -1, 1)
    return (base * torch.sin(tok * 0.37 + pos * 0.011)).to(layout.torch_dtype)


def store_demo(
    store: Annotated[
        Path | None,
        typer.Option("--store", help="Store root; the store is DIR/<layout>/ (default: a temporary one)."),
    ] = None,
    agents: Annotated[int, typer.Option(min=1, help="Number of agents.")] = 6,
    turns: Annotated[int, typer.Option(min=1, help="Turns per agent.")] = 4,
    system_tokens: Annotated[int, typer.Option(min=0, help="Tokens of the shared system prompt.")] = 1024,
    turn_tokens: Annotated[int, typer.Option(min=1, help="New tokens per turn.")] = 200,
    json_out: JsonOption = False,
) -> None:
    """Agents sharing a system prompt write KV, the store restarts, every session is verified."""
    layout = SMOLLM2_LAYOUT
    if store is not None:
        check_writable_root(store)
    root = store_for_layout(store, layout) if store else Path(tempfile.mkdtemp(prefix="kvstrata-demo-"))
    # exact ladder: the demo checks restores bit for bit (lossy ladders are measured by `eval codecs`)
    config = StoreConfig(l1_budget_bytes=64 * MiB, l2_budget_bytes=128 * MiB, ladder=CodecLadder.exact())
    rng = np.random.default_rng(0)
    system = rng.integers(0, 49_152, system_tokens).tolist()
    histories: dict[str, list[int]] = {}
    started = time.perf_counter()
    with (
        KVStore(root, layout, model_fingerprint=b"synthetic-demo", config=config) as kv,
        progress_bar(not json_out, transient=True) as bar,
    ):
        for a in range(agents):
            kv.create_session(f"agent-{a}", exist_ok=True)
        for _turn in bar.track(range(turns), description="agents writing turns"):
            for a in range(agents):
                session = kv.session(f"agent-{a}")
                new = (system if session.num_tokens == 0 else []) + rng.integers(
                    0, 49_152, turn_tokens
                ).tolist()
                kv.append(session, new, synthetic_kv(layout, new, session.num_tokens))
                kv.checkpoint(session)
                histories[session.id] = list(session.token_ids)
        write_s = time.perf_counter() - started
    # a new store object over the same directory: what a restarted process sees
    reopen_started = time.perf_counter()
    rows = []
    with KVStore(root, layout, model_fingerprint=b"synthetic-demo", config=config) as kv:
        open_s = time.perf_counter() - reopen_started
        for sid, tokens in histories.items():
            t0 = time.perf_counter()
            loaded = kv.load(kv.session(sid))
            load_ms = (time.perf_counter() - t0) * 1000
            expected = synthetic_kv(layout, tokens, 0)
            exact = loaded.kv is not None and torch.equal(loaded.kv, expected)
            rows.append(
                {
                    "agent": sid,
                    "tokens": loaded.num_tokens,
                    "restore_ms": round(load_ms, 1),
                    "restore_gbps": round(layout.block_nbytes(loaded.num_tokens) / (load_ms / 1000) / 1e9, 2),
                    "bit_exact": exact,
                    "by_tier": {k.name: v for k, v in loaded.tokens_by_tier.items()},
                }
            )
        stats = kv.stats()
    logical = sum(layout.block_nbytes(len(t)) for t in histories.values())
    on_disk = next(t.used_bytes for t in stats.tiers if t.tier == "L3")
    result = {
        "store": str(root),
        "write_seconds": round(write_s, 2),
        "reopen_seconds": round(open_s, 3),
        "agents": rows,
        "logical_kv_bytes": logical,
        "l3_bytes": on_disk,
        "dedup_ratio": round(logical / on_disk, 2) if on_disk else None,
        "tiers": [{"tier": t.tier, "blocks": t.blocks, "bytes": t.used_bytes} for t in stats.tiers],
    }
    if store is None:
        shutil.rmtree(root, ignore_errors=True)
    if json_out:
        print_json(result)
        return
    table = Table(
        title=f"{agents} agents, restored after a restart (store reopened in {open_s * 1000:.0f} ms)"
    )
    for col in ("agent", "tokens", "restore ms", "GB/s", "bit-exact", "tokens by tier"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["agent"],
            str(r["tokens"]),
            str(r["restore_ms"]),
            str(r["restore_gbps"]),
            "yes" if r["bit_exact"] else "[red]NO[/red]",
            str(r["by_tier"]),
        )
    console.print(table)
    console.print(
        f"logical KV {logical / MiB:.1f} MiB, on disk {on_disk / MiB:.1f} MiB: "
        f"deduplication saves {result['dedup_ratio']}x (shared system prompt stored once)"
    )
    if not all(r["bit_exact"] for r in rows):
        raise typer.Exit(1)
