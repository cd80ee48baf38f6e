"""``kvstrata bench decode-overhead``: per-token decode latency with kvstrata's cache against
transformers' ``DynamicCache``: what kvstrata adds on the hot path.

For each prompt length P, the prompt is prefilled once and its KV kept. Each repeat then decodes
N tokens greedily twice, once per variant, in an order that alternates from repeat to repeat:

- ``kvstrata``: the session is in a store (L1); the cache comes from ``cache_for`` with room for
  the answer reserved, as the engine builds it, and each step is the engine's step (a one-token
  forward with ``logits_to_keep=1``, greedy pick). After the answer the new tokens are committed
  to the store (``commit``: append + checkpoint), timed apart: it happens once per turn, off
  the per-token path;
- ``DynamicCache``: the same KV copied into a fresh ``DynamicCache``, the same steps.

Both variants start from the same KV and must produce the same tokens. Each step is timed from
building the input tensor to the picked token; the figures are medians and p90 over all steps
of all repeats, and the overhead is kvstrata's median over DynamicCache's.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench.common.command import (
    AttnOption,
    JsonOutOption,
    ModelOption,
    PlotOption,
    RepeatsOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.common.measure import (
    fmt_ms,
    frozen_heap,
    median,
    parse_int_list,
    percentile,
    rotate,
    verdict,
)
from kvstrata.bench.common.models import load_bench_model, prefill_kv, prompt_token_ids
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import bench_config, open_store, room_for, workdir
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvstrata.integrations.transformers.model import LoadedModel

SUITE = "decode-overhead"
KVSTRATA, DYNAMIC = "kvstrata", "DynamicCache"
VARIANTS = (KVSTRATA, DYNAMIC)
TARGET_OVERHEAD = 0.05

PromptsOption = Annotated[str, typer.Option("--prompts", help="Comma-separated prompt lengths in tokens.")]
TokensOption = Annotated[int, typer.Option("--tokens", min=1, help="Tokens decoded per run.")]


def command(
    model: ModelOption = None,
    prompts: PromptsOption = "512,2048",
    tokens: TokensOption = 128,
    repeats: RepeatsOption = 3,
    attn: AttnOption = "sdpa",
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Per-token decode latency: kvstrata's cache against transformers' DynamicCache."""
    with one_line_errors():
        lengths = parse_int_list(prompts, "--prompts")
        result = run(model=model, prompts=lengths, tokens=tokens, repeats=repeats, attn=attn)
    show(result, json_out=json_out, plot=plot)


def run(
    *,
    model: str | Path | None = None,
    prompts: list[int] | None = None,
    tokens: int = 128,
    repeats: int = 3,
    attn: str = "sdpa",
    progress: bool = True,
) -> BenchResult:
    import torch

    lengths = sorted(set(prompts or [512, 2048]))
    if tokens < 1 or repeats < 1:
        raise ConfigError("tokens and repeats must be >= 1")
    if any(p < 1 for p in lengths):
        raise ConfigError("prompt lengths must be >= 1")
    per_prompt: dict[str, Any] = {}
    with workdir(None, "kvstrata-bench-decode-") as work:
        loaded = load_bench_model(model, workdir=work, attn=attn)
        token_ids = prompt_token_ids(loaded, max(lengths))
        limit = getattr(loaded.model.config, "max_position_embeddings", None)
        if limit is not None and max(lengths) + tokens > limit:
            raise ConfigError(f"prompt {max(lengths)} + {tokens} tokens exceed the model's {limit} positions")
        with frozen_heap(), progress_bar(progress) as bar, torch.inference_mode():
            task = bar.add_task("decode-overhead", total=len(lengths) * (1 + 2 * repeats))
            for p in lengths:
                per_prompt[str(p)] = _measure_prompt(
                    loaded, token_ids[:p], tokens, repeats, work / f"p{p}", bar, task
                )
    data = {"model": loaded.name, "target_overhead": TARGET_OVERHEAD, "prompts": per_prompt}
    params = {"model": str(model) if model else None, "prompts": lengths, "tokens": tokens}
    params |= {"repeats": repeats, "attn": attn}
    return BenchResult(SUITE, params, data, _tables(data), plot=lambda fig: _plot(fig, data))


def _dynamic_cache(kv: torch.Tensor, config: Any) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer in range(kv.shape[1]):
        cache.update(kv[0, layer].unsqueeze(0).clone(), kv[1, layer].unsqueeze(0).clone(), layer)
    return cache


def _decode(model: Any, cache: Any, first: int, steps: int) -> tuple[list[float], list[int]]:
    """The engine's decode step, ``steps`` times: returns per-step seconds and the tokens fed."""
    import torch

    device = model.get_input_embeddings().weight.device
    token = first
    times: list[float] = []
    fed: list[int] = []
    for _ in range(steps):
        started = time.perf_counter()
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        fed.append(token)
        token = int(out.logits[0, -1].float().argmax())
        times.append(time.perf_counter() - started)
    return times, fed


def _measure_prompt(
    loaded: LoadedModel, prompt: list[int], tokens: int, repeats: int, root: Path, bar: Any, task: Any
) -> dict[str, Any]:
    from kvstrata.integrations.transformers.cache import cache_for, commit

    model = loaded.model
    p = len(prompt)
    bar.update(task, description=f"decode-overhead: prefill {p} tokens")
    kv, logits = prefill_kv(loaded, prompt)
    first = int(logits.argmax())
    nbytes = (p + tokens) * kv[:, :, :, :1].numel() * kv.element_size()
    config = bench_config(room_for(nbytes * 2 * repeats))
    bar.advance(task)
    step_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    run_medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    commit_s: list[float] = []
    fed: dict[str, list[int]] = {}
    with open_store(loaded, root, config) as store:
        for repeat in range(repeats):
            # a namespace per repeat: the committed answer is new to the store every time
            session = store.create_session("decoder", f"repeat-{repeat}", priority="realtime")
            store.append(session, prompt, kv)
            store.checkpoint(session)
            for variant in rotate(VARIANTS, repeat):
                bar.update(task, description=f"decode-overhead: {p} tokens, repeat {repeat + 1}, {variant}")
                gc.collect()
                if variant == KVSTRATA:
                    cache = cache_for(store, session, model=model, extra_tokens=tokens)
                else:
                    cache = _dynamic_cache(kv, model.config)
                times, ids = _decode(model, cache, first, tokens)
                if variant == KVSTRATA:
                    started = time.perf_counter()
                    commit(store, session, cache, ids)
                    commit_s.append(time.perf_counter() - started)
                step_s[variant] += times
                run_medians[variant].append(median(times))
                fed.setdefault(variant, ids)
                del cache
                bar.advance(task)
    kv_med, dyn_med = median(step_s[KVSTRATA]), median(step_s[DYNAMIC])
    paired = [k / d - 1 for k, d in zip(run_medians[KVSTRATA], run_medians[DYNAMIC], strict=True)]
    return {
        "prompt_tokens": p,
        "decoded_tokens": tokens,
        "variants": {
            v: {
                "median_step_s": median(step_s[v]),
                "p90_step_s": percentile(step_s[v], 90),
                "run_median_step_s": run_medians[v],
                "step_s": step_s[v],
            }
            for v in VARIANTS
        },
        "overhead": kv_med / dyn_med - 1,
        "overhead_p90": percentile(step_s[KVSTRATA], 90) / percentile(step_s[DYNAMIC], 90) - 1,
        "paired_run_overheads": paired,
        "same_tokens": fed[KVSTRATA] == fed[DYNAMIC],
        "commit_s": commit_s,
        "median_commit_s": median(commit_s),
    }


def _tables(data: dict[str, Any]) -> list[BenchTable]:
    table = BenchTable(
        "Per-token decode latency (ms): kvstrata's cache against DynamicCache",
        [
            "prompt",
            "tokens",
            "kvstrata median",
            "DynamicCache median",
            "overhead (median)",
            "kvstrata p90",
            "DynamicCache p90",
            "overhead (p90)",
            "same tokens",
            "commit after turn",
        ],
    )
    for key, entry in data["prompts"].items():
        k, d = entry["variants"][KVSTRATA], entry["variants"][DYNAMIC]
        table.add_row(
            key,
            entry["decoded_tokens"],
            fmt_ms(k["median_step_s"] * 1e3),
            fmt_ms(d["median_step_s"] * 1e3),
            f"{entry['overhead'] * 100:+.1f}%",
            fmt_ms(k["p90_step_s"] * 1e3),
            fmt_ms(d["p90_step_s"] * 1e3),
            f"{entry['overhead_p90'] * 100:+.1f}%",
            "yes" if entry["same_tokens"] else "NO",
            f"{fmt_ms(entry['median_commit_s'] * 1e3)} ms",
        )
    worst = max((e["overhead"] for e in data["prompts"].values()), default=float("nan"))
    table.notes.append(
        f"target: at most {TARGET_OVERHEAD:.0%} over DynamicCache; worst median overhead "
        f"{worst * 100:+.1f}% ({verdict(worst, TARGET_OVERHEAD, at_most=True)})"
    )
    table.notes.append(
        "commit after turn: append + checkpoint of the answer's KV into the store, once per turn "
        "(not on the per-token path)"
    )
    return [table]


def _plot(fig: Any, data: dict[str, Any]) -> None:
    import numpy as np

    keys = sorted(data["prompts"], key=int)
    left, right = fig.subplots(1, 2)
    for i, key in enumerate(keys):
        entry = data["prompts"][key]
        for variant, style in ((KVSTRATA, "-"), (DYNAMIC, "--")):
            steps = np.asarray(entry["variants"][variant]["step_s"]) * 1e3
            n = entry["decoded_tokens"]
            per_position = np.median(steps.reshape(-1, n), axis=0) if steps.size % n == 0 else steps
            left.plot(per_position, style, color=f"C{i}", label=f"{variant}, prompt {key}", linewidth=1)
    left.set_xlabel("decoded token")
    left.set_ylabel("step latency (ms, median over repeats)")
    left.set_title("per-token decode latency", fontsize=9)
    left.legend(fontsize=7)
    left.grid(True, alpha=0.3)
    positions = np.arange(len(keys))
    width = 0.38
    for j, (variant, stat) in enumerate(((KVSTRATA, "median_step_s"), (DYNAMIC, "median_step_s"))):
        ys = [data["prompts"][k]["variants"][variant][stat] * 1e3 for k in keys]
        right.bar(positions + j * width, ys, width, label=variant)
    for pos, key in zip(positions, keys, strict=True):
        overhead = data["prompts"][key]["overhead"]
        top = max(data["prompts"][key]["variants"][v]["median_step_s"] for v in VARIANTS) * 1e3
        right.annotate(
            f"{overhead * 100:+.1f}%", (pos + width / 2, top), ha="center", va="bottom", fontsize=8
        )
    right.set_xticks(positions + width / 2, [f"prompt {k}" for k in keys])
    right.set_ylabel("ms per token (median)")
    right.set_title("median step and kvstrata's overhead", fontsize=9)
    right.legend(fontsize=7)
    right.grid(True, axis="y", alpha=0.3)
