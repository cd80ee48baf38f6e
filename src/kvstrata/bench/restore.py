"""``kvstrata bench restore``: resuming a session from each tier against recomputing it, and
kvstrata's restore and checkpoint against the raw hardware on the same bytes, in one run.

For each context length N the session is prefilled once (N tokens of public-domain text) and
committed into a store under the exact codec ladder, so every restore is bit-exact (with
``--lossy`` also into a second store under the default ladder, where an interactive session's
older blocks are int8 in L3). The default contexts run on SmolLM2's KV geometry; the
``--tiny-contexts`` (32,768 tokens by default) on a tiny random Llama shaped for a long context:
a large KV and a fast forward. Each repeat then runs every variant once, in an order that
rotates from repeat to repeat, each kvstrata path next to its baselines (L1 and L2 with memcpy, L3
with the cold reads, the checkpoint with write+fsync); the figures are medians, and each ratio
against the hardware is the median of the repeats' ratios (kvstrata's sample over its baseline's
of the same repeat, taken moments apart), reported beside the ratio of the medians.

kvstrata, through its public API (``KVStore.load`` / ``append`` / ``checkpoint``):

- ``L1`` / ``L2``: the blocks are in the device pool / host arena of a store with only that
  memory tier (warmed once, so an L2 hit is served as such and not promoted);
- ``L3 cold`` (and ``L3 cold (int8)``): a store without memory tiers, its data files dropped from
  the page cache (``fsync`` + ``posix_fadvise(DONTNEED)``) just before the request;
- ``checkpoint``: the whole session appended and checkpointed (blocks durable in L3, index
  committed) into a fresh store without memory tiers;
- ``recompute``: the whole context plus the new token through the model, no cache.

The raw hardware, the same bytes: ``memcpy`` (a tensor copy into a warm destination), ``cold
read`` (one file of the KV's size, read sequentially after dropping its pages), ``cold read, 8
in flight`` (the exact store's own data files, read whole by 8 threads after dropping their
pages) and ``write+fsync`` (the KV's bytes written to one new file and fsynced). Each timed write
(the checkpoint and write+fsync) follows one untimed write+fsync of the same bytes whose pages are
then dropped, so that both find the disk and the free memory in the same state (see
``_Context._wake_disk_writes``).

A request is one new token after the N stored ones. TTFT runs from the request (looking the
session up) to the first token picked: ``store.load`` + building the ``KVStrataCache`` + a
one-token forward. Restore throughput is the KV bytes / ``store.load`` (into the previous
request's buffer, as the engine does; the cache then adopts that buffer).
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench.command import (
    AttnOption,
    JsonOutOption,
    ModelOption,
    PlotOption,
    RepeatsOption,
    WorkdirOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.hardware import (
    cold_parallel_read_s,
    cold_sequential_read_s,
    drop_page_cache,
    drop_store_page_cache,
    memcpy_s,
    overwrite_fsync,
    store_data_bytes,
    store_data_files,
    write_baseline_file,
    write_fsync_s,
)
from kvstrata.bench.measure import (
    frozen_heap,
    parse_int_list,
    parse_optional_int_list,
    rotate,
)
from kvstrata.bench.models import TINY, TinyShape, load_bench_model, prefill_kv, prompt_token_ids
from kvstrata.bench.report import BenchResult
from kvstrata.bench.restore_report import (
    CHECKPOINT,
    L1,
    L2,
    L3,
    L3_LOSSY,
    MEMCPY,
    PAR_READ,
    RECOMPUTE,
    SEQ_READ,
    TARGETS,
    WRITE_FSYNC,
    plot,
    summarize,
    tables,
)
from kvstrata.bench.stores import Restorer, bench_config, commit_session, open_store, room_for, workdir
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvstrata.integrations.transformers.model import LoadedModel

SUITE = "restore"
DEFAULT_CONTEXTS = "512,1024,2048,4096,8192"
DEFAULT_TINY_CONTEXTS = "32768"
TINY_SHAPE = TinyShape(layers=2, hidden=256, heads=4, kv_heads=4)
"""The long-context model: 4 KiB of fp32 KV a token (128 MiB at 32,768 tokens), a fast forward."""
IN_FLIGHT = 8

ContextsOption = Annotated[
    str, typer.Option("--contexts", help="Context lengths in tokens (comma-separated) on --model.")
]
TinyContextsOption = Annotated[
    str,
    typer.Option(
        "--tiny-contexts",
        help="Context lengths on a tiny random Llama with a large KV and a fast forward ('' for none).",
    ),
]
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


def command(
    model: ModelOption = None,
    contexts: ContextsOption = DEFAULT_CONTEXTS,
    tiny_contexts: TinyContextsOption = DEFAULT_TINY_CONTEXTS,
    repeats: RepeatsOption = 3,
    lossy: LossyOption = True,
    recompute_repeats: RecomputeRepeatsOption = None,
    attn: AttnOption = "sdpa",
    workdir_: WorkdirOption = None,
    json_out: JsonOutOption = False,
    plot_: PlotOption = None,
) -> None:
    """Resume a session from L1, L2, cold L3 and by recompute; restore and checkpoint GB/s against
    memcpy, cold reads and write+fsync of the same bytes."""
    with one_line_errors():
        result = run(
            model=model,
            contexts=parse_int_list(contexts, "--contexts", minimum=2),
            tiny_contexts=parse_optional_int_list(tiny_contexts, "--tiny-contexts", minimum=2),
            repeats=repeats,
            lossy=lossy,
            recompute_repeats=recompute_repeats,
            attn=attn,
            workdir=workdir_,
        )
    show(result, json_out=json_out, plot=plot_)


def run(
    *,
    model: str | Path | None = None,
    contexts: list[int] | None = None,
    tiny_contexts: list[int] | None = None,
    repeats: int = 3,
    lossy: bool = True,
    recompute_repeats: int | None = None,
    attn: str = "sdpa",
    workdir: Path | None = None,
    tiny_shape: TinyShape = TINY_SHAPE,
    progress: bool = True,
) -> BenchResult:
    """Measure every variant for every context length; see the module docstring."""
    lengths = sorted(set(contexts if contexts is not None else parse_int_list(DEFAULT_CONTEXTS, "contexts")))
    tiny_lengths = sorted(set(tiny_contexts or []))
    recomputes = repeats if recompute_repeats is None else min(recompute_repeats, repeats)
    if repeats < 1 or recomputes < 0:
        raise ConfigError("repeats must be >= 1 and recompute_repeats >= 0")
    if any(n < 2 for n in lengths + tiny_lengths):
        raise ConfigError("context lengths must be at least 2 tokens")
    if not lengths and not tiny_lengths:
        raise ConfigError("give at least one context length")
    # each kvstrata path next to its baselines in every repeat (the groups rotate, and so does the
    # order within each): samples taken moments apart find the machine in the same state
    groups = [[L1, L2, MEMCPY], [L3, SEQ_READ, PAR_READ], *([[L3_LOSSY]] if lossy else [])]
    groups += [[CHECKPOINT, WRITE_FSYNC], [RECOMPUTE]]
    variants = [v for group in groups for v in group]
    steps = 1 + repeats * (len(variants) - 1) + recomputes
    per_context: dict[str, Any] = {}
    models: dict[str, Any] = {}
    parts = [(model, lengths, False), (TINY, tiny_lengths, True)]
    with (
        _workdir(workdir) as root,
        frozen_heap(),
        progress_bar(progress) as bar,
    ):
        task = bar.add_task(SUITE, total=(len(lengths) + len(tiny_lengths)) * steps)
        for spec, part_lengths, is_tiny in parts:
            if not part_lengths:
                continue
            shape = dataclasses.replace(tiny_shape, max_positions=max(part_lengths) + 1)
            loaded = load_bench_model(spec, workdir=root, attn=attn, tiny=shape if is_tiny else None)
            models["tiny" if is_tiny else "main"] = {
                "name": loaded.name,
                "layout": loaded.layout().describe(),
            }
            token_ids = prompt_token_ids(loaded, max(part_lengths) + 1)
            for n in part_lengths:
                label = f"{n} (tiny)" if is_tiny else str(n)
                bar.update(task, description=f"restore: building a {n}-token session")
                entry = _measure_context(
                    loaded, token_ids[: n + 1], root / f"ctx-{label.replace(' ', '')}", repeats, recomputes,
                    groups, bar, task,
                )  # fmt: skip
                entry["model"] = loaded.name
                per_context[label] = entry
            del loaded
            gc.collect()
    data = {"models": models, "targets": TARGETS, "in_flight": IN_FLIGHT, "contexts": per_context}
    params = {
        "model": str(model) if model else None,
        "contexts": lengths,
        "tiny_contexts": tiny_lengths,
        "tiny_shape": dataclasses.asdict(tiny_shape),
        "repeats": repeats,
        "lossy": lossy,
        "recompute_repeats": recomputes,
        "attn": attn,
    }
    return BenchResult(SUITE, params, data, tables(data, lossy), plot=lambda fig: plot(fig, data, lossy))


def _workdir(path: Path | None) -> Any:
    return workdir(Path(path) if path is not None else None, "kvstrata-bench-restore-")


# -- one context --------------------------------------------------------------------------------


def _measure_context(
    loaded: LoadedModel,
    token_ids: list[int],
    root: Path,
    repeats: int,
    recomputes: int,
    groups: list[list[str]],
    bar: Any,
    task: Any,
) -> dict[str, Any]:
    n = len(token_ids) - 1
    variants = [v for group in groups for v in group]
    started = time.perf_counter()
    kv, _ = prefill_kv(loaded, token_ids[:n])
    prefill_s = time.perf_counter() - started
    context = _Context(loaded, token_ids, kv, root, lossy=L3_LOSSY in variants)
    bar.advance(task)
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    try:
        context.warm()
        for repeat in range(repeats):
            for variant in order(groups, repeat):
                if variant == RECOMPUTE and repeat >= recomputes:
                    continue
                bar.update(task, description=f"restore: {n} tokens, repeat {repeat + 1}/{repeats}, {variant}")
                gc.collect()
                samples[variant].append(context.measure(variant, repeat))
                bar.advance(task)
    finally:
        context.close()
    if recomputes == 0:
        # the build prefill (N tokens through the model, logits of the last) stands in
        samples[RECOMPUTE].append({"ttft_s": prefill_s, "from_build_prefill": 1.0})
    return summarize(
        n, context.nbytes, prefill_s, samples, context.checks, context.logits, context.disk_bytes
    )


def order(groups: list[list[str]], repeat: int) -> list[str]:
    """The variants in the order repeat ``repeat`` runs them: the groups rotated, and each group's
    variants rotated, so that a kvstrata path and its baselines always run one after another and
    none always runs first."""
    return [variant for group in rotate(groups, repeat) for variant in rotate(group, repeat)]


class _Context:
    """One context length's stores and baselines: the session committed once (exact, and under the
    default ladder with ``lossy``), opened per path; the raw baselines' files and buffers."""

    def __init__(
        self, loaded: LoadedModel, token_ids: list[int], kv: torch.Tensor, root: Path, *, lossy: bool
    ):
        import numpy as np
        import torch

        from kvstrata.integrations.transformers.cache import layer_devices

        self.loaded, self.kv, self.root = loaded, kv, root
        self.history, self.new_token = token_ids[:-1], token_ids[-1]
        self.nbytes = nbytes = kv.numel() * kv.element_size()
        self.roots = {L3: root / "exact", **({L3_LOSSY: root / "lossy"} if lossy else {})}
        with open_store(loaded, self.roots[L3], bench_config(room_for(nbytes))) as store:
            commit_session(store, self.history, kv)
        if lossy:
            with open_store(
                loaded, self.roots[L3_LOSSY], bench_config(room_for(nbytes), ladder="default")
            ) as store:
                commit_session(store, self.history, kv, priority="interactive")
        self.disk_bytes = {path: store_data_bytes(r) for path, r in self.roots.items()}
        configs = {
            L1: bench_config(room_for(nbytes), 0),
            L2: bench_config(0, room_for(nbytes)),
            L3: bench_config(0, 0),
            L3_LOSSY: bench_config(0, 0, ladder="default"),
        }
        self.stores = {
            path: open_store(loaded, self.roots.get(path, self.roots[L3]), configs[path], read_only=True)
            for path in (L1, L2, L3, *([L3_LOSSY] if lossy else []))
        }
        devices = layer_devices(loaded.model)
        spare: list[Any] = []  # one restore buffer, recycled from request to request (as the engine)
        self.restorers = {path: Restorer(store, devices, spare=spare) for path, store in self.stores.items()}
        self.data_files = store_data_files(self.roots[L3])
        self.baseline = write_baseline_file(root / "baseline.bin", nbytes)
        self.read_buffer = np.ones(max(nbytes, self.disk_bytes[L3]), dtype=np.uint8)  # paged in
        self.src = kv.reshape(-1).view(torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # first touch of the pages, outside the timings
        self.checks: dict[str, dict[str, Any]] = {}
        self.logits: dict[str, torch.Tensor] = {}

    def warm(self) -> None:
        """Put the blocks in the memory tiers: one load promotes them from L3."""
        for path in (L1, L2):
            restorer = self.restorers[path]
            restorer.recycle(restorer.restore(build_cache=False))

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def measure(self, variant: str, repeat: int) -> dict[str, float]:
        """One sample of ``variant``: a resumed request, a recompute, a checkpoint or a baseline."""
        import torch

        with torch.inference_mode():
            if variant in self.stores:
                if variant in (L3, L3_LOSSY):
                    drop_store_page_cache(self.roots[variant])
                return self._resumed_request(variant)
            if variant == RECOMPUTE:
                started = time.perf_counter()
                ids = torch.tensor(
                    [[*self.history, self.new_token]], dtype=torch.long, device=self.loaded.model.device
                )
                logits = (
                    self.loaded.model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[0, -1].float()
                )
                int(logits.argmax())
                elapsed = time.perf_counter() - started
                self.logits.setdefault(variant, logits)
                return {"ttft_s": elapsed}
            if variant in (CHECKPOINT, WRITE_FSYNC):
                self._wake_disk_writes()
            if variant == CHECKPOINT:
                path = self.root / f"checkpoint-{repeat}"
                try:
                    with open_store(self.loaded, path, bench_config(0, 0)) as store:
                        return {"seconds": commit_session(store, self.history, self.kv).checkpoint_s}
                finally:
                    shutil.rmtree(path, ignore_errors=True)
        if variant == MEMCPY:
            return {"seconds": memcpy_s(self.src, self.dst)}
        if variant == SEQ_READ:
            return {"seconds": cold_sequential_read_s(self.baseline, self.read_buffer[: self.nbytes])}
        if variant == PAR_READ:
            return {"seconds": cold_parallel_read_s(self.data_files, self.read_buffer, in_flight=IN_FLIGHT)}
        if variant == WRITE_FSYNC:
            return {"seconds": write_fsync_s(self.root / "write-fsync.bin", self.src.numpy())}
        raise AssertionError(f"unknown variant {variant}")

    def _wake_disk_writes(self) -> None:
        """Put the disk and the memory in the same state before each timed write (the checkpoint
        or its baseline): write and fsync the same bytes once, untimed, over a kept file, then
        drop that file's pages.

        The write: this VM's disk writes 3-5x slower after idling a second or two (94 MB
        write+fsync: 180-500 ms after 2 s idle, 50-60 ms back to back), so without it each sample
        fell into the slow or the fast mode at random. Over a kept file, because a file removed
        here would free its blocks in the journal commit that the timed write waits for.

        The drop: the VM hands free memory back to its host about 2 s after it is freed (free
        page reporting), and the page cache a write fills comes from free memory: memory freed
        moments before is ready, memory handed back faults page by page (a 2.9 MB record took
        5.4 ms of CPU to write instead of 0.7). In the rotation, write+fsync came right after the
        checkpoint had freed its pages and wrote into them; the checkpoint came after reads that
        had taken back what they freed, and every other record of it was slow (0.42-0.6x in
        three runs). The bytes freed here leave both the same ready memory."""
        kept = self.root / "wake-up.bin"
        overwrite_fsync(kept, self.src.numpy())
        drop_page_cache([kept])  # on each CPU: the checkpoint's writer thread runs on either

    def _resumed_request(self, path: str) -> dict[str, float]:
        """One resumed request: restore the session, forward the new token, pick the first token;
        the first one of each path also checks which tier served it and that its KV is exact."""
        import torch

        restorer = self.restorers[path]
        restored = restorer.restore()
        forward_started = time.perf_counter()
        ids = torch.tensor([[self.new_token]], dtype=torch.long, device=self.loaded.model.device)
        out = self.loaded.model(input_ids=ids, cache=restored.cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        int(logits.argmax())
        forward_s = time.perf_counter() - forward_started
        if path not in self.checks:
            kv = restored.loaded.kv
            self.checks[path] = {
                "served_by": {level.name: count for level, count in restored.loaded.tokens_by_tier.items()},
                "kv_bit_exact": bool(kv is not None and torch.equal(kv, self.kv)),
            }
            self.logits[path] = logits
        restorer.recycle(restored)
        return {
            "ttft_s": restored.restore_s + forward_s,
            "load_s": restored.load_s,
            "restore_s": restored.restore_s,
            "forward_s": forward_s,
        }
