"""``kvstrata bench agents``: many agents in one memory budget, kvstrata against fixed buffers.

The scenario of the project's seeds: agents share a system prompt and hold growing multi-turn
conversations. Half of them are **hot** (the ``interactive`` class, one request per simulated
second each), half **background** (the ``background`` class, one request per ten simulated
seconds), interleaved ``hot, background, hot, ...`` by agent number.

Both contenders get the same memory budget: ``--budget-buffers`` fixed buffers of
``--buffer-tokens`` tokens at full precision of the model's KV.

- **Fixed-buffer baseline**: each admitted agent owns one preallocated buffer of
  ``--buffer-tokens`` (the engine's own cache class, written in place, so the compute path is the
  engine's; nothing shared, nothing compressed, no store); agents beyond the budget are refused,
  and so is a request whose conversation outgrows its buffer.
- **kvstrata**: the :class:`~kvstrata.engine.Engine` with the default policy (``cost`` eviction,
  default codec ladder, ``l1_resident_sessions``), its L1 and L2 together sized to the same budget
  less one buffer (the decoded working KV of the running request lives outside the tiers, so it
  is charged here). L3 on local disk is behind them: extra capacity, not counted as memory.

The CPU cannot serve ten requests per second of a real model, so the run uses a **simulated
clock**: requests are released in order of their simulated arrival, one simulated second at a
time (each second's requests are submitted to the engine's priority scheduler together), and the
measured time to first token is the real time of the request itself (tokenise, find and load the
cached prefix, prefill the rest), without the queueing a real 1 req/s load would add on 2 cores.

The sweep runs a single hot agent alone first (the unloaded reference), then each agent count of
``--agents``; it reports the largest count whose hot-class P99 TTFT stays within ``--p99-limit``
(1.1x) of the unloaded P99.

``--pool`` runs instead device memory holding each class in its codec against exact device
memory, on the wall clock with the engine batching requests as they come (:mod:`.pool`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench.agents.report import result
from kvstrata.bench.agents.workload import (
    CLASS_PRIORITY,
    AgentsParams,
    RunStats,
    Turn,
    common_prefix,
    schedule,
    slots,
    system_message,
    user_message,
)
from kvstrata.bench.common.command import (
    JsonOutOption,
    ModelOption,
    PlotOption,
    WorkdirOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.common.measure import parse_int_list
from kvstrata.bench.common.models import forward_logits, load_bench_model, stop_ids
from kvstrata.bench.common.result import BenchResult
from kvstrata.bench.common.stores import tier_bytes, workdir
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    from rich.progress import Progress

    from kvstrata.integrations.transformers.model import LoadedModel


# -- kvstrata ----------------------------------------------------------------------------------------
def run_kvstrata(
    model: LoadedModel, params: AgentsParams, num_agents: int, root: Path, progress: Progress
) -> RunStats:
    from kvstrata import KVStore, StoreConfig
    from kvstrata.engine import Engine
    from kvstrata.engine.engine import GenerationRequest

    layout = model.layout()
    budget = params.budget_buffers * params.buffer_tokens * layout.bytes_per_token
    tiers_budget = budget - params.buffer_tokens * layout.bytes_per_token
    l1 = int(tiers_budget * params.l1_share)
    config = StoreConfig(l1_budget_bytes=l1, l2_budget_bytes=tiers_budget - l1)
    system = system_message(params.system_chars)
    events = schedule(num_agents, params.duration_s)
    histories: dict[int, list[dict[str, str]]] = {a: [system] for a in range(num_agents)}
    turns: list[Turn] = []
    peak = {"L1": 0, "L2": 0, "L3": 0}
    task = progress.add_task(f"kvstrata, {num_agents} agent(s)", total=len(events) + 1)
    with KVStore(root, layout, model_fingerprint=model.fingerprint, config=config) as store:
        engine = Engine(model, store, l1_resident_sessions=params.l1_resident_sessions, queue_limit=1024)

        def sample(*_: Any) -> None:
            for tier, n in tier_bytes(store).items():
                peak[tier] = max(peak[tier], n)

        try:
            # The shared system prompt is written once before the clock starts (an operator's
            # warm-up), so that no measured agent pays for it.
            engine.chat(
                "warmup",
                [system, {"role": "user", "content": "Ready?"}],
                max_new_tokens=1,
                priority="interactive",
            )
            engine.forget("warmup")
            store.delete_session("warmup")
            progress.advance(task)
            started = time.perf_counter()
            for slot in slots(events):
                pending = []
                for event in slot:
                    messages = [
                        *histories[event.agent],
                        {"role": "user", "content": user_message(event.agent, event.turn)},
                    ]
                    request = GenerationRequest(
                        f"agent-{event.agent}",
                        messages=messages,
                        max_new_tokens=params.max_new_tokens,
                        priority=CLASS_PRIORITY[event.cls],
                    )
                    future = engine.submit(request)
                    future.add_done_callback(sample)
                    pending.append((event, messages, future))
                for event, messages, future in pending:
                    reply = future.result()
                    histories[event.agent] = [*messages, {"role": "assistant", "content": reply.text}]
                    turns.append(
                        Turn(
                            f"agent-{event.agent}",
                            event.cls,
                            event.turn,
                            event.time_s,
                            reply.prompt_tokens,
                            reply.cached_tokens,
                            reply.prefill_tokens,
                            reply.ttft_ms,
                            reply.total_ms,
                            reply.completion_tokens,
                            {k: v for k, v in reply.cached_by_tier.items() if v},
                        )
                    )
                    progress.advance(task)
                sample()
            wall = time.perf_counter() - started
        finally:
            engine.close()
        sample()
    return RunStats(
        "kvstrata",
        num_agents,
        len({t.agent for t in turns}),
        0,
        0,
        len(turns),
        wall,
        sum(t.prompt_tokens for t in turns),
        sum(t.completion_tokens for t in turns),
        sum(t.prefill_tokens for t in turns),
        peak,
        budget,
        turns,
    )


# -- the fixed-buffer baseline -----------------------------------------------------------------------


def run_baseline(model: LoadedModel, params: AgentsParams, num_agents: int, progress: Progress) -> RunStats:
    """Each admitted agent reserves ``buffer_tokens`` of full-precision KV; first come, first served."""
    import torch

    from kvstrata.integrations.transformers.cache import KVStrataCache, layer_devices

    layout = model.layout()
    devices = layer_devices(model.model)
    buffer_bytes = params.buffer_tokens * layout.bytes_per_token
    budget = params.budget_buffers * buffer_bytes
    admitted = set(range(min(num_agents, budget // buffer_bytes)))
    system = system_message(params.system_chars)
    events = [e for e in schedule(num_agents, params.duration_s) if e.agent in admitted]
    histories: dict[int, list[dict[str, str]]] = {a: [system] for a in admitted}
    caches: dict[int, tuple[list[int], Any]] = {}
    stops = stop_ids(model)
    tokenizer = model.tokenizer
    turns: list[Turn] = []
    refused_requests = 0
    used_peak = 0
    task = progress.add_task(f"fixed buffers, {num_agents} agent(s)", total=len(events))
    started = time.perf_counter()
    for event in events:
        messages = [
            *histories[event.agent],
            {"role": "user", "content": user_message(event.agent, event.turn)},
        ]
        t0 = time.perf_counter()
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = [int(t) for t in (encoded["input_ids"] if hasattr(encoded, "keys") else encoded)]
        if len(prompt) + params.max_new_tokens > params.buffer_tokens:
            refused_requests += 1  # the conversation outgrew its fixed buffer
            progress.advance(task)
            continue
        tokens, cache = caches.get(event.agent, ([], None))
        keep = min(common_prefix(tokens, prompt), len(prompt) - 1)
        with torch.inference_mode():
            if cache is None:
                # the agent's fixed buffer: buffer_tokens of KV, preallocated, written in place
                empty = torch.zeros(layout.block_shape(0), dtype=layout.torch_dtype)
                cache = KVStrataCache.from_kv(empty, devices=devices, extra_tokens=params.buffer_tokens)
            elif keep < cache.get_seq_length():
                cache.crop(keep - cache.get_seq_length())  # a negative count removes tokens
            logits = forward_logits(model, prompt[keep:], cache)
            generated = [int(torch.argmax(logits))]
            ttft = time.perf_counter() - t0
            while generated[-1] not in stops and len(generated) < params.max_new_tokens:
                generated.append(int(torch.argmax(forward_logits(model, generated[-1:], cache))))
        total = time.perf_counter() - t0
        caches[event.agent] = (prompt + generated[:-1], cache)
        used_peak = max(used_peak, sum(len(toks) for toks, _ in caches.values()) * layout.bytes_per_token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        histories[event.agent] = [*messages, {"role": "assistant", "content": text}]
        turns.append(
            Turn(
                f"agent-{event.agent}",
                event.cls,
                event.turn,
                event.time_s,
                len(prompt),
                keep,
                len(prompt) - keep,
                ttft * 1e3,
                total * 1e3,
                len(generated),
            )
        )
        progress.advance(task)
    wall = time.perf_counter() - started
    return RunStats(
        "fixed buffers",
        num_agents,
        len(admitted),
        num_agents - len(admitted),
        refused_requests,
        len(turns),
        wall,
        sum(t.prompt_tokens for t in turns),
        sum(t.completion_tokens for t in turns),
        sum(t.prefill_tokens for t in turns),
        {"reserved": len(admitted) * buffer_bytes, "KV in use": used_peak},
        budget,
        turns,
    )


# -- the suite ---------------------------------------------------------------------------------------
def run(
    params: AgentsParams | None = None,
    *,
    model: LoadedModel | None = None,
    work: Path | None = None,
    show_progress: bool = True,
    pool: bool = False,
) -> BenchResult:
    """The simulated-clock sweep against fixed buffers; with ``pool``, encoded against exact
    device memory on the wall clock instead (:mod:`.pool`)."""
    params = params or AgentsParams()
    with workdir(work, "kvstrata-bench-agents-") as root:
        if pool:
            from kvstrata.bench.agents.pool import pool_result, run_pool

            if model is None:
                model = load_bench_model(params.model, workdir=root, tiny=params.tiny)
            with progress_bar(show_progress) as progress:
                runs = run_pool(model, params, root, progress)
            return pool_result(params, model, model.layout(), runs)
        if model is None:
            model = load_bench_model(params.model, workdir=root, tiny=params.tiny)
        layout = model.layout()
        system_tokens = len(model.tokenizer(system_message(params.system_chars)["content"])["input_ids"])
        if system_tokens + params.max_new_tokens >= params.buffer_tokens:
            raise ConfigError(
                f"the system prompt ({system_tokens} tokens) does not fit a {params.buffer_tokens}-token "
                "buffer: lower --system-chars or raise --buffer-tokens"
            )
        counts = sorted(set(params.agents))
        with progress_bar(show_progress) as progress:
            unloaded = run_kvstrata(model, params, 1, root / "store-unloaded", progress)
            sweep = [run_kvstrata(model, params, n, root / f"store-{n}", progress) for n in counts]
            # last, in a process that has run the model for a while (the first passes are slow)
            baseline = run_baseline(model, params, params.baseline_agents, progress)
    return result(params, model, layout, system_tokens, baseline, unloaded, sweep)


# -- the command -------------------------------------------------------------------------------------
def command(
    agents: Annotated[str, typer.Option(help="Agent counts to sweep (1:1 hot:background).")] = "4,8,12,20",
    baseline_agents: Annotated[int, typer.Option(help="Agents offered to the fixed-buffer baseline.")] = 20,
    duration: Annotated[float, typer.Option(help="Simulated seconds of traffic.")] = 12.0,
    budget_buffers: Annotated[int, typer.Option(help="Memory budget, in fixed buffers.")] = 4,
    buffer_tokens: Annotated[int, typer.Option(help="Tokens of one fixed per-agent buffer.")] = 2048,
    l1_share: Annotated[float, typer.Option(help="Share of kvstrata's memory budget given to L1.")] = 0.5,
    l1_resident_sessions: Annotated[int, typer.Option(help="Engine: sessions kept decoded in L1.")] = 4,
    system_chars: Annotated[
        int, typer.Option(help="Characters of shared reference text in the system prompt.")
    ] = 4000,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per reply.")] = 4,
    p99_limit: Annotated[float, typer.Option(help="Hot P99 limit, as a multiple of the unloaded P99.")] = 1.1,
    pool: Annotated[
        bool,
        typer.Option(
            "--pool",
            help="Encoded against exact device memory (L1) on the wall clock, hot agents alone as the "
            "reference (issue 33), instead of the simulated-clock sweep against fixed buffers.",
        ),
    ] = False,
    repeats: Annotated[
        int, typer.Option(help="--pool: runs of each system per agent count, the order rotated each time.")
    ] = 1,
    warmup: Annotated[
        bool, typer.Option("--warmup/--no-warmup", help="--pool: an untimed run before the measured ones.")
    ] = True,
    model: ModelOption = None,
    workdir_: WorkdirOption = None,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Many agents in one memory budget: kvstrata against fixed per-agent buffers (simulated clock)."""
    with one_line_errors():
        params = AgentsParams(
            agents=tuple(parse_int_list(agents, "--agents")),
            baseline_agents=baseline_agents,
            duration_s=duration,
            budget_buffers=budget_buffers,
            buffer_tokens=buffer_tokens,
            l1_share=l1_share,
            l1_resident_sessions=l1_resident_sessions,
            system_chars=system_chars,
            max_new_tokens=max_new_tokens,
            p99_limit=p99_limit,
            model=model,
            repeats=repeats,
            warmup=warmup,
        )
        result = run(params, work=workdir_, pool=pool)
    show(result, json_out=json_out, plot=plot)
