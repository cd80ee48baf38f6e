"""A stop drains (issue 30, acceptance 1): vLLM's OpenAI server with the connector answers a long
prompt and gets SIGTERM at once (within a few milliseconds of the answer), first to its main
process only (as a container runtime sends it), then to its whole process group (as systemd
does): after a restart the prompt's full blocks are served from the store.

Nothing waits for the index before the stop (no ``wait_indexed``): a user does not. vLLM is left
at its defaults (``--shutdown-timeout 0``, which kills the engine at once on SIGTERM): the
connector raises vLLM's shutdown timeout to its ``drain_timeout_s``, and its worker side finishes
the saves in flight before the process exits.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from pathlib import Path

import pytest
from servers import Server

from conftest import BLOCK, VOCAB_HIGH, VOCAB_LOW, Models

PROMPT_TOKENS = 7 * BLOCK + 60
ANSWER_TOKENS = BLOCK - 60 + 1
"""The answer's last step computes the token that completes the eighth block (the last generated
token's KV is never computed): that block's save is planned in the very step that ends the
answer, so it is in flight when the SIGTERM comes."""


def long_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(PROMPT_TOKENS)]


def full_blocks(tokens: list[int]) -> int:
    """The tokens a hit can cover: the full blocks but the one with the last token."""
    return (len(tokens) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def root(work_dir: Path) -> Path:
    return work_dir / "drain-root"


def stop_right_after_the_answer(server: Server, tokens: list[int], *, group: bool) -> tuple[int, list[int]]:
    """Answer ``tokens``, SIGTERM the server at once; its exit code and the answer."""
    reply = server.complete(tokens, ANSWER_TOKENS)
    assert server.process is not None
    if group:
        os.killpg(server.process.pid, signal.SIGTERM)
    else:
        os.kill(server.process.pid, signal.SIGTERM)
    assert reply.cached_tokens == 0
    process = server.process
    code = process.wait(120)
    Server._reap_group(process.pid)  # the engine and worker processes too
    server.process = None
    return code, reply.tokens


@pytest.fixture(scope="module")
def stops(work_dir: Path, models: Models, root: Path) -> dict[str, object]:
    """Three servers on one store root: the first answers prompt A and gets SIGTERM on its main
    process; the second continues A's conversation, answers B and gets SIGTERM on its process
    group; the third continues B's."""
    a, b = long_prompt(1), long_prompt(2)
    out: dict[str, object] = {}
    servers = []

    def server(name: str) -> Server:
        started = Server(work_dir, name, models.a, store_root=root, max_model_len=2048).start().wait_ready()
        servers.append(started)
        return started

    try:
        first = server("drain-1")
        out["exit_main"], answer_a = stop_right_after_the_answer(first, a, group=False)
        out["log_1"] = first.log_tail(200_000)
        out["events_1"] = first.events()
        second = server("drain-2")
        out["a"] = a + answer_a + [VOCAB_LOW] * 5  # the conversation goes on
        out["a_again"] = second.complete(out["a"], 4).cached_tokens  # type: ignore[arg-type]
        out["exit_group"], answer_b = stop_right_after_the_answer(second, b, group=True)
        out["log_2"] = second.log_tail(200_000)
        out["events_2"] = second.events()
        third = server("drain-3")
        out["b"] = b + answer_b + [VOCAB_LOW] * 5
        out["b_again"] = third.complete(out["b"], 4).cached_tokens  # type: ignore[arg-type]
    finally:
        for started in servers:
            with contextlib.suppress(Exception):
                started.stop(signal.SIGKILL)
    return out


def worker_drained(events: list[dict[str, object]]) -> None:
    """The worker that saved the blocks drained its store on the stop, nothing left unsaved (the
    scheduler's process drains too when vLLM gets to shut it down; its store holds no KV)."""
    savers = {e["pid"] for e in events if e["event"] == "save"}
    drains = [e for e in events if e["event"] == "drain"]
    assert savers and savers <= {e["pid"] for e in drains}, drains
    assert all(e["unsaved"] == 0 for e in drains), drains


def test_sigterm_to_the_main_process_right_after_the_answer_keeps_its_blocks(stops) -> None:
    assert stops["a_again"] == full_blocks(stops["a"])  # type: ignore[arg-type]
    assert stops["exit_main"] == 0
    assert "raised from 0 to 10 s" in stops["log_1"]  # type: ignore[operator]
    worker_drained(stops["events_1"])  # type: ignore[arg-type]


def test_sigterm_to_the_process_group_right_after_the_answer_keeps_its_blocks(stops) -> None:
    assert stops["b_again"] == full_blocks(stops["b"])  # type: ignore[arg-type]
    worker_drained(stops["events_2"])  # type: ignore[arg-type]
