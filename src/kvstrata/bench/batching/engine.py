"""Continuous batching through the whole Engine (issue 16, acceptance 1 and 2), for
``kvstrata bench batching --modes engine,priority``.

**engine**: N sessions hold histories of different lengths in a store (the KV of real
public-domain text, appended and checkpointed as a finished turn leaves it). Each session's
request resumes its history (restored from L1), prefills the next text token and decodes
``steps`` tokens (greedy, EOS ignored), all N submitted at once, through the same Engine code
twice: batched (``max_batch = N``) and with batching off (``max_batch = 1``: one row per step,
the requests one after the other). The variants alternate (``repeats`` times each, in rotating
order) so that load from elsewhere on the machine falls on both; medians are reported.
Aggregate decode throughput is N x steps over the wall time of the burst (from submission to the
last token: restores, prefills and the engine's own work included); ITL is the time between two
tokens of one request (every gap of every request: median and p90); TTFT from submission.

**priority**: 16 background sessions decode long answers; once they all run, a realtime
session with its own history arrives (a new question of ``rt_prompt`` tokens after it, then
``rt_tokens`` tokens). Its TTFT and median ITL are compared with the same request on the idle
engine (a fresh session with the same history, measured before and after the loaded runs), and
the background tokens decoded while it ran are counted (from the engine's step reports).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.bench.common.measure import percentile, rotate
from kvstrata.bench.common.result import BenchTable
from kvstrata.runtime import release_openmp_threads

if TYPE_CHECKING:
    import torch

    from kvstrata.engine import Engine, Response, StepReport
    from kvstrata.integrations.transformers.model import LoadedModel
    from kvstrata.store import KVStore

BLOCK_TOKENS = 64
BATCHED, SERIAL = "batched", "max batch 1"
PRIORITY_TARGETS = {"ttft": 1.2, "itl": 1.5}


class Histories:
    """Sessions whose histories are prefixes of one text: appended to a store like finished turns
    (the blocks are content-addressed, so the shared prefixes are stored once)."""

    def __init__(self, store: KVStore, kv: torch.Tensor, text: list[int]) -> None:
        self.store, self.kv, self.text = store, kv, text
        self._count = 0

    def make(self, length: int, priority: str = "interactive") -> str:
        import torch

        self._count += 1
        name = f"s{self._count}"
        with torch.inference_mode():
            session = self.store.create_session(name, priority=priority)
            self.store.append(session, self.text[:length], self.kv[:, :, :, :length])
            self.store.checkpoint(session)
        return name


def open_store(root: Path, loaded: LoadedModel) -> KVStore:
    from kvstrata import KVStore, StoreConfig
    from kvstrata.policy.ladder import CodecLadder

    # room for every session in L1: this measures decoding, not demotion
    config = StoreConfig(ladder=CodecLadder.exact(), l1_budget_bytes=8 << 30, l2_budget_bytes=1 << 30)
    return KVStore(root, loaded.layout(BLOCK_TOKENS), model_fingerprint=loaded.fingerprint, config=config)


def engine_for(loaded: LoadedModel, store: KVStore, max_batch: int) -> Engine:
    from kvstrata.engine import Engine

    return Engine(loaded, store, max_batch=max_batch, queue_limit=4096, l1_resident_sessions=4096)


def burst(engine: Engine, sessions: list[tuple[str, int]], text: list[int], steps: int) -> dict[str, Any]:
    """Submit every session's next request at once; wait for all of them."""
    from kvstrata.engine import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_tokens=steps, ignore_eos=True)
    release_openmp_threads()  # this thread's torch work since the last burst left it a team
    started = time.perf_counter()
    # stream() starts a request without a prefetch hint: restores are part of what is measured
    streams = [
        engine.stream(GenerationRequest(name, prompt_ids=text[: length + 1], sampling=sampling))
        for name, length in sessions
    ]
    responses = [stream.result() for stream in streams]
    wall = time.perf_counter() - started
    return _figures(responses, wall)


def _figures(responses: list[Response], wall: float) -> dict[str, Any]:
    gaps = [gap / 1e3 for r in responses for gap in r.inter_token_ms]
    ttfts = [r.ttft_ms / 1e3 for r in responses]
    tokens = sum(r.completion_tokens for r in responses)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "itl_median_s": statistics.median(gaps) if gaps else float("nan"),
        "itl_p90_s": percentile(gaps, 90) if gaps else float("nan"),
        "ttft_median_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts),
    }


def measure_throughput(
    loaded: LoadedModel,
    kv: torch.Tensor,
    text: list[int],
    counts: list[int],
    lengths_for: Any,
    steps: int,
    repeats: int,
    advance: Any,
) -> dict[str, Any]:
    """Per session count: the batched engine against the same engine with ``max_batch=1``."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-batching-") as tmp:
        store = open_store(Path(tmp) / "store", loaded)
        histories = Histories(store, kv, text)
        try:
            for n in counts:
                lengths = lengths_for(n)
                engines = {BATCHED: engine_for(loaded, store, n), SERIAL: engine_for(loaded, store, 1)}
                for engine in engines.values():  # the first steps of an engine pay one-time costs
                    burst(engine, [(histories.make(lengths[0]), lengths[0])], text, 2)
                runs: dict[str, list[dict[str, Any]]] = {BATCHED: [], SERIAL: []}
                for repeat in range(repeats):
                    for variant in rotate([BATCHED, SERIAL], repeat):
                        sessions = [(histories.make(length), length) for length in lengths]
                        runs[variant].append(burst(engines[variant], sessions, text, steps))
                        advance()
                for engine in engines.values():
                    engine.close()
                results[str(n)] = _summary(n, lengths, steps, runs)
        finally:
            store.close()
    return results


def _summary(n: int, lengths: list[int], steps: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"sessions": n, "histories": lengths, "steps": steps, "runs": runs}
    for variant, measured in runs.items():
        out[variant] = {
            key: statistics.median(run[key] for run in measured)
            for key in ("tokens_per_s", "itl_median_s", "itl_p90_s", "ttft_median_s", "ttft_max_s")
        }
    out["speedup"] = out[BATCHED]["tokens_per_s"] / out[SERIAL]["tokens_per_s"]
    return out


def measure_priority(
    loaded: LoadedModel,
    kv: torch.Tensor,
    text: list[int],
    *,
    background: int,
    lengths: list[int],
    bg_tokens: int,
    rt_history: int,
    rt_prompt: int,
    rt_tokens: int,
    max_batch: int,
    repeats: int,
    advance: Any,
) -> dict[str, Any]:
    """A realtime request alone, and arriving while ``background`` sessions decode."""
    from kvstrata.engine import GenerationRequest, SamplingParams

    rt_ids = text[: rt_history + rt_prompt]
    rt_sampling = SamplingParams(max_tokens=rt_tokens, ignore_eos=True)
    unloaded: list[dict[str, Any]] = []
    loaded_runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvstrata-priority-") as tmp:
        store = open_store(Path(tmp) / "store", loaded)
        histories = Histories(store, kv, text)
        engine = engine_for(loaded, store, max_batch)
        steps: list[tuple[float, StepReport]] = []
        engine.add_step_listener(lambda report: steps.append((time.perf_counter(), report)))

        def realtime() -> Response:
            name = histories.make(rt_history, "realtime")
            request = GenerationRequest(name, prompt_ids=rt_ids, sampling=rt_sampling, priority="realtime")
            return engine.stream(request).result()

        def unloaded_run() -> dict[str, Any]:
            mark = len(steps)
            figures = _rt_figures(realtime())
            figures["step_s"] = statistics.median(r.seconds for _, r in steps[mark:] if not r.interrupted)
            return figures

        try:
            realtime()  # warm-up: the first steps of an engine pay one-time costs
            for _ in range(repeats):
                unloaded.append(unloaded_run())
                advance()
                loaded_runs.append(
                    _loaded_run(engine, histories, text, steps, lengths, bg_tokens, background, realtime)
                )
                advance()
            unloaded.append(unloaded_run())
        finally:
            engine.close()
            store.close()
    return _priority_summary(unloaded, loaded_runs, background, max_batch)


def _rt_figures(response: Response) -> dict[str, Any]:
    gaps = response.inter_token_ms
    return {
        "ttft_s": response.ttft_ms / 1e3,
        "queued_s": response.queued_ms / 1e3,
        "itl_median_s": statistics.median(gaps) / 1e3 if gaps else float("nan"),
        "itl_p90_s": percentile(gaps, 90) / 1e3 if gaps else float("nan"),
        "itl_mean_s": statistics.fmean(gaps) / 1e3 if gaps else float("nan"),
        "cached_tokens": response.cached_tokens,
        "prefill_tokens": response.prefill_tokens,
    }


def _loaded_run(
    engine: Engine,
    histories: Histories,
    text: list[int],
    steps: list[tuple[float, StepReport]],
    lengths: list[int],
    bg_tokens: int,
    background: int,
    realtime: Any,
) -> dict[str, Any]:
    from kvstrata.engine import GenerationRequest, SamplingParams
    from kvstrata.engine.batch import Phase
    from kvstrata.priority import Priority

    sampling = SamplingParams(max_tokens=bg_tokens, ignore_eos=True)
    # every session is stored before the first request starts: a checkpoint's fsync between two
    # submissions (slow on a busy disk) let the first requests finish before the last started
    names = [(histories.make(length, "background"), length) for length in lengths[:background]]
    streams = [
        engine.stream(
            GenerationRequest(name, prompt_ids=text[: length + 1], sampling=sampling, priority="background")
        )
        for name, length in names
    ]
    # wait until every background request decodes, then a few steps more
    while engine.batch_stats().running[Priority.BACKGROUND] < background:
        ended = [stream for stream in streams if stream.done()]
        if ended:  # a failure raises here; one that finished first would leave the load short forever
            response = ended[0].result()
            reason = response.finish_reason
            raise RuntimeError(f"a background request ended ({reason}) before all {background} ran")
        time.sleep(0.01)
    mark = len(steps)
    while len(steps) < mark + 4:
        time.sleep(0.01)
    before_start = time.perf_counter()
    before_mark = len(steps)
    time.sleep(max(0.5, steps[-1][1].seconds * 3))  # background throughput alone, a few steps
    arrived = time.perf_counter()
    response = realtime()
    ended = time.perf_counter()
    for stream in streams:
        stream.cancel()
    for stream in streams:
        stream.result()

    def bg_tokens_between(start: float, stop: float) -> int:
        count = 0
        for at, report in steps:
            if start <= at <= stop and not report.interrupted:
                count += sum(
                    1
                    for slot in report.plan.slots
                    if slot.priority is Priority.BACKGROUND and slot.phase is Phase.DECODE
                )
        return count

    figures = _rt_figures(response)
    figures["bg_tokens_per_s_during"] = bg_tokens_between(arrived, ended) / (ended - arrived)
    figures["bg_tokens_per_s_before"] = bg_tokens_between(before_start, arrived) / (arrived - before_start)
    during = [r for at, r in steps[before_mark:] if arrived <= at <= ended]
    figures["rows_per_step_during"] = (
        statistics.mean(len(r.plan.slots) for r in during if not r.interrupted) if during else 0.0
    )
    figures["interrupted_steps"] = sum(r.interrupted for r in during)
    figures["step_s"] = statistics.median(r.seconds for r in during if not r.interrupted) if during else 0.0
    return figures


def _priority_summary(
    unloaded: list[dict[str, Any]], loaded_runs: list[dict[str, Any]], background: int, max_batch: int
) -> dict[str, Any]:
    def med(runs: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(run[key] for run in runs))

    out: dict[str, Any] = {"background": background, "max_batch": max_batch}
    out["unloaded"] = {
        k: med(unloaded, k)
        for k in ("ttft_s", "queued_s", "itl_median_s", "itl_p90_s", "itl_mean_s", "step_s")
    }
    keys = ("ttft_s", "queued_s", "itl_median_s", "itl_p90_s", "itl_mean_s", "step_s")
    keys += ("bg_tokens_per_s_during", "bg_tokens_per_s_before")
    out["loaded"] = {k: med(loaded_runs, k) for k in (*keys, "rows_per_step_during")}
    out["ttft_ratio"] = out["loaded"]["ttft_s"] / out["unloaded"]["ttft_s"]
    out["itl_ratio"] = out["loaded"]["itl_median_s"] / out["unloaded"]["itl_median_s"]
    out["itl_mean_ratio"] = out["loaded"]["itl_mean_s"] / out["unloaded"]["itl_mean_s"]
    out["runs"] = {"unloaded": unloaded, "loaded": loaded_runs}
    return out


def throughput_table(
    dtype: str, model: str, results: dict[str, Any], targets: dict[int, float]
) -> BenchTable:
    from kvstrata.bench.common.measure import fmt_s_as_ms

    table = BenchTable(
        f"Engine, batched against batching off, {dtype} ({model}; ITL and TTFT in ms)",
        ["N", "off tok/s", "batched tok/s", "speedup", "ITL off", "ITL batched", "ITL p90", "TTFT batched"],
    )
    for key, entry in results.items():
        off, on = entry[SERIAL], entry[BATCHED]
        table.add_row(
            key,
            f"{off['tokens_per_s']:.1f}",
            f"{on['tokens_per_s']:.1f}",
            f"{entry['speedup']:.2f}x",
            fmt_s_as_ms(off["itl_median_s"]),
            fmt_s_as_ms(on["itl_median_s"]),
            fmt_s_as_ms(on["itl_p90_s"]),
            fmt_s_as_ms(on["ttft_median_s"]),
        )
    for count, target in targets.items():
        entry = results.get(str(count))
        if entry is not None:
            verdict = "met" if entry["speedup"] >= target else "MISSED"
            table.notes.append(
                f"target at {count} sessions: {target:.0f}x; measured {entry['speedup']:.2f}x ({verdict})"
            )
    table.notes.append(
        "tok/s: N x steps over the wall time of the burst (submission to last token, restores and "
        "prefills included), median of the runs; off: the same Engine with max_batch=1; ITL: time "
        "between two tokens of a request (median, p90); TTFT: submission to first token (median)"
    )
    return table


def priority_table(dtype: str, model: str, result: dict[str, Any]) -> BenchTable:
    from kvstrata.bench.common.measure import fmt_s_as_ms

    table = BenchTable(
        f"A realtime request arriving while {result['background']} background sessions decode, "
        f"{dtype} ({model}; ms)",
        ["", "TTFT", "ITL", "ITL p90", "ITL mean", "background tok/s"],
    )
    alone, busy = result["unloaded"], result["loaded"]
    table.add_row(
        "idle engine",
        fmt_s_as_ms(alone["ttft_s"]),
        fmt_s_as_ms(alone["itl_median_s"]),
        fmt_s_as_ms(alone["itl_p90_s"]),
        fmt_s_as_ms(alone["itl_mean_s"]),
        "-",
    )
    table.add_row(
        "under load",
        fmt_s_as_ms(busy["ttft_s"]),
        fmt_s_as_ms(busy["itl_median_s"]),
        fmt_s_as_ms(busy["itl_p90_s"]),
        fmt_s_as_ms(busy["itl_mean_s"]),
        f"{busy['bg_tokens_per_s_during']:.1f} (before: {busy['bg_tokens_per_s_before']:.1f})",
    )
    for key, label in (("ttft", "TTFT"), ("itl", "ITL"), ("itl_mean", "mean ITL")):
        ratio, target = result[f"{key}_ratio"], PRIORITY_TARGETS[key.removesuffix("_mean")]
        verdict = "met" if ratio <= target else "MISSED"
        table.notes.append(f"{label} under load / idle: {ratio:.2f}x (target <= {target}x: {verdict})")
    table.notes.append(
        f"rows per step while the realtime request ran: {busy['rows_per_step_during']:.1f}; medians of "
        "the runs; background tok/s: background tokens decoded while the realtime request ran (before: "
        "in the same run, just before it arrived)"
    )
    return table
