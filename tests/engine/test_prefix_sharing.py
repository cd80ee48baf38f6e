"""In-flight prefix sharing: agents that arrive together with one system prompt compute it once.

Eight requests share a 205-token prefix and each has a suffix of its own; they are submitted at
the same moment, so none of the prefix is in the store when they open. One of them computes it;
the others wait for its blocks and load them (25 full blocks), take the KV of the shared prefix's
last 5 tokens from its row (copied when they are reopened, so however late their open runs), and
compute only their suffix. The work is counted in the prompt
tokens the batch's steps computed (their prefill chunks), not in times. A computing request that
is cancelled leaves its waiters to compute the rest themselves; a waiter cancelled while it waits
ends at once; a realtime request never waits behind an interactive one's prefill.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from kvstrata import KVStore, StoreConfig
from kvstrata.engine import Engine, GenerationRequest, Response, SamplingParams, StepReport
from kvstrata.engine.batch import StepBudget
from kvstrata.engine.budget import batch_budget
from kvstrata.engine.engine import _COMMIT_RANK
from kvstrata.engine.inflight import InFlight, RowState
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder

BLOCK_TOKENS = 8
SHARED = [(13 * i) % 180 + 20 for i in range(205)]  # 25 full blocks and 5 tokens of a 26th
AGENTS = 8
SUFFIX = 20
CHUNK = 64  # a prefill chunk in the tests that stop the computing request between its chunks
TIMEOUT = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    return load_model(save_tiny_llama(root / "model", seed=7), cache_dir=root / "cache", progress=False)


def prompt(agent: int) -> list[int]:
    return SHARED + [(agent * 31 + j * 7) % 150 + 3 for j in range(SUFFIX)]


def request(agent: int, priority: str = "interactive", tokens: int = 6) -> GenerationRequest:
    sampling = SamplingParams(tokens, 0.0, ignore_eos=True)
    return GenerationRequest(f"agent-{agent}", prompt_ids=prompt(agent), sampling=sampling, priority=priority)


class Engines:
    """An engine on a fresh store, counting the prompt tokens its steps compute."""

    def __init__(self, tiny: LoadedModel, root: Path, *, share: bool, budget: StepBudget | None = None):
        config = StoreConfig(ladder=CodecLadder.exact())
        layout = tiny.layout(BLOCK_TOKENS)
        self.store = KVStore(root, layout, model_fingerprint=tiny.fingerprint, config=config)
        self.engine = Engine(tiny, self.store, share_prefixes=share, budget=budget)
        self.computed = 0  # prompt tokens the steps computed (every request's prefill chunks)
        self.steps = 0
        self.engine.add_step_listener(self._count)

    def _count(self, report: StepReport) -> None:
        if report.interrupted:
            return
        self.steps += bool(report.plan.slots)
        self.computed += sum(s.tokens for s in report.plan.slots if s.phase.value == "prefill")

    def close(self) -> None:
        self.engine.close()
        self.store.close()


def chunked() -> StepBudget:
    return replace(batch_budget(16), prefill_chunk=CHUNK)


def run_together(tiny: LoadedModel, root: Path, *, share: bool) -> tuple[list[Response], int]:
    run = Engines(tiny, root, share=share)
    try:
        with run.engine.store_lock:  # no row opens before the last request arrived: at the same moment
            futures = [run.engine.submit(request(i)) for i in range(AGENTS)]
        return [future.result(timeout=TIMEOUT) for future in futures], run.computed
    finally:
        run.close()


def test_agents_that_arrive_together_compute_the_shared_prefix_once(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    shared, computed_shared = run_together(tiny, tmp_path / "shared", share=True)
    alone, computed_alone = run_together(tiny, tmp_path / "alone", share=False)
    # without sharing, every agent computes the whole prompt (none of it was stored yet)
    assert [r.cached_tokens for r in alone] == [0] * AGENTS
    assert computed_alone == AGENTS * (len(SHARED) + SUFFIX)
    # with it, one computes it and the seven others load its 25 blocks (and take the 5 tokens past them)
    cached = sorted(r.cached_tokens for r in shared)
    assert cached == [0] + [len(SHARED)] * (AGENTS - 1)
    assert computed_shared == len(SHARED) + AGENTS * SUFFIX  # what the steps computed
    assert sum(r.prefill_tokens for r in shared) == computed_shared  # what the responses say
    # the same answers as each computed alone
    assert [r.token_ids for r in shared] == [r.token_ids for r in alone]


def test_a_cancelled_computing_request_leaves_its_waiters_to_compute_the_rest(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    run = Engines(tiny, tmp_path / "store", share=True, budget=chunked())
    cancelled = threading.Event()
    try:

        def cancel_after_the_first_chunk(report: StepReport) -> None:
            if report.plan.slots and not cancelled.is_set():
                cancelled.set()
                first.cancel()  # stops it before its next step: it computed one chunk

        run.engine.add_step_listener(cancel_after_the_first_chunk)
        with run.engine.store_lock:
            first = run.engine.stream(request(0))  # opened first: it computes the prefix
            futures = [run.engine.submit(request(i)) for i in range(1, AGENTS)]
        others = [future.result(timeout=TIMEOUT) for future in futures]
        owner = first.result(timeout=TIMEOUT)
    finally:
        run.close()
    assert owner.finish_reason == "cancelled"
    assert [r.finish_reason for r in others] == ["length"] * (AGENTS - 1)
    # one of the waiters computed the rest of the prefix (from the cancelled one's saved chunk
    # on), the others loaded it: the prefix was computed once in all
    assert sorted(r.cached_tokens for r in others) == [CHUNK] + [len(SHARED)] * (AGENTS - 2)
    assert run.computed == len(SHARED) + (AGENTS - 1) * SUFFIX


def test_a_waiter_cancelled_while_it_waits_ends_and_the_others_go_on(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    run = Engines(tiny, tmp_path / "store", share=True, budget=chunked())
    seen = threading.Event()
    try:

        def cancel_a_waiter(report: StepReport) -> None:
            if report.plan.slots and not seen.is_set():
                seen.set()
                # the store worker opened every request by now: agent 3 waits for agent 0's blocks
                run.engine._worker.wait_idle(TIMEOUT)
                handles[3].cancel()

        run.engine.add_step_listener(cancel_a_waiter)
        with run.engine.store_lock:
            handles = [run.engine.stream(request(i)) for i in range(AGENTS)]
        responses = [handle.result(timeout=TIMEOUT) for handle in handles]
    finally:
        run.close()
    waiter = responses.pop(3)
    assert waiter.finish_reason == "cancelled" and waiter.token_ids == []
    assert [r.finish_reason for r in responses] == ["length"] * (AGENTS - 1)
    assert sorted(r.cached_tokens for r in responses) == [0] + [len(SHARED)] * (AGENTS - 2)
    assert run.computed == len(SHARED) + (AGENTS - 1) * SUFFIX


def test_a_realtime_request_does_not_wait_for_an_interactive_prefill(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """An interactive request computes the prefix; a realtime one arriving meanwhile computes it
    too (its steps come first); a background one waits for the interactive one's blocks."""
    run = Engines(tiny, tmp_path / "store", share=True, budget=chunked())
    later: dict[str, object] = {}
    try:

        def arrive_during_its_prefill(report: StepReport) -> None:
            if report.plan.slots and not later:
                later["realtime"] = run.engine.submit(request(1, "realtime"))
                later["background"] = run.engine.submit(request(2, "background"))
                run.engine._worker.wait_idle(TIMEOUT)  # both opened while agent 0 computes

        run.engine.add_step_listener(arrive_during_its_prefill)
        # agent 0 decodes long enough to be running still when the background request opens (its open
        # is queued by the step thread and may run only after the realtime request ended)
        interactive = run.engine.submit(request(0, tokens=48)).result(timeout=TIMEOUT)
        realtime = later["realtime"].result(timeout=TIMEOUT)  # type: ignore[attr-defined]
        background = later["background"].result(timeout=TIMEOUT)  # type: ignore[attr-defined]
    finally:
        run.close()
    assert interactive.cached_tokens == 0
    assert realtime.cached_tokens == 0  # nothing of the prefix was stored yet: it computed it all
    assert background.cached_tokens == len(SHARED)  # it waited for agent 0's blocks
    assert run.computed == 2 * len(SHARED) + 3 * SUFFIX


def test_a_waiter_opened_after_the_computing_request_committed_gets_the_whole_prefix(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """The waiter's open runs only after the computing request finished and committed (its row
    freed): it still takes the 5 tokens past the full blocks, lent when its blocks were saved."""
    run = Engines(tiny, tmp_path / "store", share=True)
    committed = threading.Event()
    held: list[InFlight] = []
    try:

        def hold_the_waiters_open(report: StepReport) -> None:
            running = run.engine._inflight.values()
            owner = next((i for i in running if i.request.session_id == "agent-0"), None)
            if owner is None:
                return
            if (owner.saving or owner.saved) and not held:  # it posted the checkpoint that reopens the waiter
                held.append(owner)  # the store worker waits after that checkpoint until it finished:
                run.engine._worker.submit(_COMMIT_RANK, lambda: committed.wait(TIMEOUT))
            if len(owner.decoder.token_ids) == 6:  # it left the batch: its commit goes before the
                committed.set()  # background waiter's open

        run.engine.add_step_listener(hold_the_waiters_open)
        with run.engine.store_lock:
            first = run.engine.submit(request(0))
            waiter = run.engine.submit(request(2, "background"))
        owner = first.result(timeout=TIMEOUT)
        background = waiter.result(timeout=TIMEOUT)
    finally:
        committed.set()
        run.close()
    assert held, "the waiter never waited for the computing request's blocks"
    assert owner.cached_tokens == 0
    assert background.cached_tokens == len(SHARED)
    assert run.computed == len(SHARED) + 2 * SUFFIX


def test_a_waiter_whose_blocks_another_request_stored_first_still_gets_the_whole_prefix(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """A background request waits for an interactive one's prefill; a realtime one computes the
    same prefix beside it and commits first, while the store worker opens the waiter only after
    that: the shared full blocks are all stored then, but the 5 tokens past them are in no block of
    the waiter's; it waits for the interactive request again, which lends them."""
    run = Engines(tiny, tmp_path / "store", share=True, budget=chunked())
    later: dict[str, object] = {}
    committed = threading.Event()
    held: list[bool] = []
    try:

        def store_the_realtime_blocks_first(report: StepReport) -> None:
            if report.plan.slots and not later:
                later["realtime"] = run.engine.submit(request(1, "realtime"))
                later["background"] = run.engine.submit(request(2, "background"))
                return
            running = {i.request.session_id: i for i in run.engine._inflight.values()}
            owner, realtime, waiter = running.get("agent-0"), running.get("agent-1"), running.get("agent-2")
            if waiter is not None and waiter.state is RowState.OPENING and waiter.waited_on is None:
                # the step thread admitted it and queued its open behind agent 0's and the realtime
                # request's store work: agent 0 goes on only once that open ran (it waits for agent 0);
                # left to the threads' timing, the open ran after agent 0 had ended in 1 of 30 runs
                # (nobody computed the 5 tokens then: it computed them itself, 200 cached)
                run.engine._worker.wait_idle(TIMEOUT)
            waits = waiter is not None and owner is not None and waiter.waited_on is owner
            if waits and (owner.saving or owner.saved) and not held:  # type: ignore[union-attr]
                held.append(True)  # after the checkpoint that reopens the waiter (it lends nothing
                # yet: the 5 tokens are not computed), the store worker waits for the realtime
                # request's commit, which then goes before the waiter's (background) open
                run.engine._worker.submit(_COMMIT_RANK, lambda: committed.wait(TIMEOUT))
            if realtime is None or len(realtime.decoder.token_ids) == 6:
                committed.set()

        run.engine.add_step_listener(store_the_realtime_blocks_first)
        # agent 0 decodes long enough to be running still when the realtime one has committed
        interactive = run.engine.submit(request(0, tokens=48)).result(timeout=TIMEOUT)
        realtime = later["realtime"].result(timeout=TIMEOUT)  # type: ignore[attr-defined]
        background = later["background"].result(timeout=TIMEOUT)  # type: ignore[attr-defined]
    finally:
        committed.set()
        run.close()
    assert held, "the waiter never waited for the interactive request's blocks"
    assert interactive.cached_tokens == 0 and realtime.cached_tokens == 0
    assert background.cached_tokens == len(SHARED)
    assert run.computed == 2 * len(SHARED) + 3 * SUFFIX


def test_a_request_arriving_after_the_blocks_were_stored_takes_the_rest_from_a_running_row(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """Agent 0 computed the shared prefix and saved its full blocks; it still decodes when agent 2
    arrives, which never waited for it: agent 2 loads the 25 stored blocks and takes the 5 tokens
    past them from agent 0's row (it computed them; no stored block holds them), not recomputed."""
    run = Engines(tiny, tmp_path / "store", share=True)
    later: dict[str, object] = {}
    try:

        def arrive_once_its_blocks_are_stored(report: StepReport) -> None:
            running = run.engine._inflight.values()
            owner = next((i for i in running if i.request.session_id == "agent-0"), None)
            if owner is not None and owner.saved >= len(SHARED) and not owner.saving and not later:
                later["late"] = run.engine.submit(request(2, "background"))

        run.engine.add_step_listener(arrive_once_its_blocks_are_stored)
        # agent 0 decodes past its first incremental checkpoint (256 tokens) and goes on for long
        # enough that agent 2's open runs while it is in the batch
        first = run.engine.submit(request(0, tokens=200)).result(timeout=TIMEOUT)
        late = later["late"].result(timeout=TIMEOUT)  # type: ignore[attr-defined]
    finally:
        run.close()
    assert first.cached_tokens == 0
    assert late.cached_tokens == len(SHARED)  # 200 from the store, 5 from agent 0's row
    assert run.computed == len(SHARED) + 2 * SUFFIX


def test_a_running_row_is_never_lent_to_another_namespace(tiny: LoadedModel, tmp_path: Path) -> None:
    """Agent 0 (namespace ``default``) computed its prompt and still decodes when two requests
    arrive whose prompts share its first 5 tokens (less than a block: the store holds none of them):
    the one in the same namespace takes those 5 tokens from agent 0's row; the one of another tenant
    computes them itself (the soak's recompute in a fresh tenant found 18 tokens taken otherwise)."""
    run = Engines(tiny, tmp_path / "store", share=True)
    later: dict[str, object] = {}
    head = SHARED[:5] + [(7 * j) % 100 + 150 for j in range(30)]

    def arrive(session: str, namespace: str) -> object:
        sampling = SamplingParams(4, 0.0, ignore_eos=True)
        return run.engine.submit(
            GenerationRequest(session, prompt_ids=head, sampling=sampling, namespace=namespace)
        )

    try:

        def arrive_while_it_decodes(report: StepReport) -> None:
            running = run.engine._inflight.values()
            owner = next((i for i in running if i.request.session_id == "agent-0"), None)
            if owner is not None and owner.saved >= len(SHARED) and not owner.saving and not later:
                later["same"] = arrive("same-tenant", "default")
                later["other"] = arrive("other-tenant", "tenant-b")

        run.engine.add_step_listener(arrive_while_it_decodes)
        run.engine.submit(request(0, tokens=200)).result(timeout=TIMEOUT)
        same = later["same"].result(timeout=TIMEOUT)  # type: ignore[attr-defined]
        other = later["other"].result(timeout=TIMEOUT)  # type: ignore[attr-defined]
    finally:
        run.close()
    assert same.cached_tokens == 5  # taken from agent 0's row, in its namespace
    assert other.cached_tokens == 0


def test_an_awaited_row_whose_prefix_ends_inside_a_block_publishes_without_taking_ids_off() -> None:
    """A row another request waits for is due for a save as soon as it computed tokens, so that
    it publishes them. Its prefix ending inside a block (a session's own tokens: 100 here, blocks
    of 16) put the last block boundary it computed before the prefix's end: ``upto`` -4, and
    ``computed_ids(0, -4)`` sliced the prompt from its end, which failed the request at its commit
    (``assert len(ids) == upto - begin``: once in 27,617 requests of a 2-hour soak)."""
    from types import SimpleNamespace

    from kvstrata.engine.session_jobs import SessionJobs

    store = SimpleNamespace(
        layout=SimpleNamespace(block_tokens=16), config=SimpleNamespace(checkpoint_every_tokens=256)
    )
    jobs = SimpleNamespace(store=store)
    prefix = SimpleNamespace(num_tokens=100, slots=100)
    for computed, saved, want in ((3, 0, 0), (3, 12, 12), (20, 12, 12), (30, 12, 28)):
        row = SimpleNamespace(length=100 + computed)
        inflight = SimpleNamespace(
            saving=False, save_error=None, session=object(), prefix=prefix, row=row,
            saved=saved, awaited=True, published=0,
        )  # fmt: skip
        upto = SessionJobs.due(jobs, inflight)  # type: ignore[arg-type]
        assert upto == want, (computed, saved, upto)
        assert upto >= inflight.saved  # the ids taken for it: upto - saved of them, never fewer
