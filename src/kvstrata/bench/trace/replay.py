"""One policy's replay of a trace slice through the engine, a turn at a time (:func:`replaying`),
the policies taking turns through it (:func:`take_turns`; one replay alone: ``take_turns([r])``);
the kept sessions read back afterwards (:func:`check_sessions`). What the bench runs and reports:
:mod:`.runner`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.bench.common.measure import rotate
from kvstrata.bench.common.stores import tier_bytes
from kvstrata.bench.trace.mooncake import TokenMap, TraceRequest, conversation_of
from kvstrata.bench.trace.params import KVSTRATA_EXACT_L1, PLAIN_LRU, TIERS, PolicyRun, Replayed
from kvstrata.errors import KVStrataError

if TYPE_CHECKING:
    from rich.progress import Progress

    from kvstrata.integrations.transformers.model import LoadedModel
    from kvstrata.layout import KVLayout


@dataclass(frozen=True, slots=True)
class Budgets:
    l1: int
    l2: int
    l3: int | None = None


def store_config(policy: str, budgets: Budgets) -> Any:
    """kvstrata's default policy (with exact device memory for ``KVSTRATA_EXACT_L1``), or plain
    LRU over exact blocks, in the same budgets."""
    from kvstrata import StoreConfig
    from kvstrata.bench.agents.pool import exact_l1_ladder
    from kvstrata.policy.ladder import CodecLadder

    config = StoreConfig(l1_budget_bytes=budgets.l1, l2_budget_bytes=budgets.l2, l3_budget_bytes=budgets.l3)
    if policy == PLAIN_LRU:
        config = dataclasses.replace(config, eviction="lru", ladder=CodecLadder.exact())
    elif policy == KVSTRATA_EXACT_L1:
        config = dataclasses.replace(config, ladder=exact_l1_ladder())
    return config


def last_turns(requests: list[TraceRequest]) -> set[int]:
    """Indexes of each conversation's last request (a one-block request is its own conversation)."""
    last: dict[object, int] = {}
    for i, request in enumerate(requests):
        conversation = conversation_of(request)
        last[conversation if conversation is not None else ("alone", i)] = i
    return set(last.values())


def take_turns(replays: list[Generator[None, None, PolicyRun]]) -> list[PolicyRun]:
    """Run ``replays`` (:func:`replaying`) a turn each, the order rotated each round, until every
    one has ended; their runs, in the order given."""
    out: dict[int, PolicyRun] = {}
    for round_ in itertools.count():
        live = [n for n in range(len(replays)) if n not in out]
        if not live:
            return [out[n] for n in range(len(replays))]
        for n in rotate(live, round_):
            try:
                next(replays[n])
            except StopIteration as stop:
                out[n] = stop.value
    raise AssertionError("unreachable")


def replaying(
    model: LoadedModel,
    layout: KVLayout,
    requests: list[TraceRequest],
    token_map: TokenMap,
    policy: str,
    root: Path,
    *,
    budgets: Budgets,
    time_scale: float,
    progress: Progress | None = None,
    repeat: int = 0,
    label: str | None = None,
    turn: int = 0,
) -> Generator[None, None, PolicyRun]:
    """Replay ``requests`` through an engine on a fresh store at ``root`` under ``policy``, a turn at
    a time: after every ``turn`` requests (0: never) the store's background work is waited for and
    control goes back to the caller (another policy's turn, :func:`take_turns`); the replay's clock
    stands still meanwhile. Its run is the value returned."""
    from kvstrata import KVStore
    from kvstrata.engine import Engine
    from kvstrata.engine.engine import GenerationRequest
    from kvstrata.store.tiers.base import TierLevel

    config = store_config(policy, budgets)
    keep = last_turns(requests) if budgets.l3 is not None else set()
    bt = token_map.block_tokens
    peak = dict.fromkeys(TIERS, 0)
    out: list[Replayed] = []
    failed: list[str] = []
    failed_blocks = 0
    kept: list[str] = []
    task = progress.add_task(label or policy, total=len(requests)) if progress is not None else None
    t0_ms = requests[0].timestamp_ms
    with KVStore(root, layout, model_fingerprint=model.fingerprint, config=config) as store:
        engine = Engine(model, store)
        started = time.perf_counter()
        try:
            for i, request in enumerate(requests):
                due = (request.timestamp_ms - t0_ms) / 1e3 / time_scale
                now = time.perf_counter() - started
                if due > now:
                    time.sleep(due - now)
                lag = max(0.0, time.perf_counter() - started - due)
                ids = token_map.prompt(request)
                session_id = f"req-{i}"
                try:
                    request_ = GenerationRequest(
                        session_id, prompt_ids=ids, max_new_tokens=1, transient=i not in keep
                    )
                    reply = engine.run(request_)
                except KVStrataError as exc:  # a checkpoint whose blocks L3 refused, for one
                    failed.append(f"request {i}: {exc}")
                    failed_blocks += len(request.hash_ids)
                    reply = None
                engine.forget(session_id)
                if i in keep and reply is not None:
                    kept.append(session_id)
                else:
                    store.delete_session(session_id)
                if reply is not None:
                    by_tier = {t: reply.cached_by_tier.get(t, 0) // bt for t in TIERS}
                    out.append(
                        Replayed(
                            i,
                            len(request.hash_ids),
                            reply.cached_tokens // bt,
                            by_tier,
                            reply.prompt_tokens,
                            reply.prefill_tokens,
                            reply.ttft_ms,
                            lag,
                            repeat,
                        )
                    )
                for tier, n in tier_bytes(store).items():
                    peak[tier] = max(peak[tier], n)
                if progress is not None and task is not None:
                    progress.advance(task)
                if turn and (i + 1) % turn == 0 and i + 1 < len(requests):
                    store.flush()  # its writes and re-encodes run in its own turn, not the next one's
                    paused = time.perf_counter()
                    yield
                    started += time.perf_counter() - paused
            wall = time.perf_counter() - started
        finally:
            engine.close()
        store.flush()
        final = tier_bytes(store)
        by_codec = {t.tier: dict(t.bytes_by_codec) for t in store.stats().tiers}
        l3 = store.counters.tiers[TierLevel.L3]
        writes = {
            "failed_requests": len(failed),
            "first_failure": failed[0] if failed else None,
            "write_failures": store.counters.write_failures,
            "l3_rejected": l3.rejected,
            "l3_evictions": l3.evictions,
            "l3_budget_bytes": budgets.l3,
        }
    sessions = check_sessions(root, layout, model.fingerprint, config, kept)
    if keep:
        sessions["conversations"] = len(keep)  # kept: those whose last request succeeded
    return PolicyRun(policy, out, wall, peak, final, by_codec, writes, sessions, failed_blocks)


def check_sessions(
    root: Path, layout: KVLayout, fingerprint: bytes, config: Any, session_ids: list[str]
) -> dict[str, Any]:
    """Reopen the store (a fresh process's view: no live sessions) and load every kept session:
    ``readable`` (every token), ``recompute`` (cut at the first block L3 no longer holds: the
    engine recomputes from there) or an error (corrupt, lost index row: what must never happen)."""
    from kvstrata import KVStore

    readable = cut = 0
    errors: list[str] = []
    with KVStore(root, layout, model_fingerprint=fingerprint, config=config) as store:
        for session_id in session_ids:
            try:
                session = store.session(session_id)
                loaded = store.load(session)
            except KVStrataError as exc:
                errors.append(f"{session_id}: {exc}")
                continue
            if loaded.missing_from_token is None and loaded.num_tokens == session.num_tokens:
                readable += 1
            else:
                cut += 1
    return {
        "kept": len(session_ids),
        "readable": readable,
        "recompute": cut,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }
