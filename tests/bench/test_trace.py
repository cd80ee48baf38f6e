"""``kvstrata bench trace``: the trace mapping, the ideal hit ratio, and a replay on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.common.models import load_bench_model
from kvstrata.bench.trace.mooncake import TokenMap, TraceRequest, ideal_hits, load_trace, select
from kvstrata.bench.trace.params import KVSTRATA, KVSTRATA_EXACT_L1, PLAIN_LRU, TraceParams
from kvstrata.bench.trace.runner import run, token_map_for
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.model import LoadedModel

BT = 4
TWO = (KVSTRATA, PLAIN_LRU)  # where device memory is not what a test checks (a shorter run)

# Two conversations that share block 0 (a system prompt); conversation A grows over three turns.
TRACE = [
    TraceRequest(0, 1200, 10, (0, 1, 2)),
    TraceRequest(100, 1300, 10, (0, 3)),
    TraceRequest(200, 2000, 10, (0, 1, 2, 4)),
    TraceRequest(300, 2500, 10, (0, 1, 2, 4, 5)),
    TraceRequest(400, 1000, 10, (0, 3)),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_bench_model("tiny", workdir=tmp_path_factory.mktemp("tiny"))


def write_trace(path: Path, requests: list[TraceRequest]) -> Path:
    lines = [
        json.dumps(
            {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )
        for r in requests
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_shared_hash_ids_give_identical_token_blocks() -> None:
    tokens = TokenMap(block_tokens=8, low=3, high=259, seed=0)
    assert tokens.block(7) == tokens.block(7) == TokenMap(8, 3, 259, 0).block(7)
    assert tokens.block(7) != tokens.block(8)
    assert all(3 <= t < 259 for t in tokens.block(7)) and len(tokens.block(7)) == 8
    a, b = tokens.prompt(TRACE[0]), tokens.prompt(TRACE[2])
    assert len(a) == 3 * 8 + 1 and len(b) == 4 * 8 + 1
    assert a[:24] == b[:24]  # ids 0,1,2 shared: the first three blocks are the same tokens
    assert a[:8] == tokens.prompt(TRACE[1])[:8] and a[8:16] != tokens.prompt(TRACE[1])[8:16]
    assert TokenMap(8, 3, 259, seed=1).block(7) != tokens.block(7)


def test_ideal_hit_ratio_on_a_constructed_trace() -> None:
    # request 1: 0,1,2 all new; 2: 0 hit, 3 new; 3: 0,1,2 hit, 4 new; 4: 0,1,2,4 hit, 5 new; 5: 0,3 hit
    assert ideal_hits(TRACE) == (1 + 3 + 4 + 2, 3 + 2 + 4 + 5 + 2, 6)


def test_load_and_select(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", TRACE)
    assert load_trace(path) == TRACE
    assert load_trace(path, limit=2) == TRACE[:2]
    # every 3rd conversation by its second block id: id 1 (A) is dropped, id 3 (B) kept, both turns
    kept = select(TRACE, sample_every=3)
    assert [r.hash_ids for r in kept] == [(0, 3), (0, 3)]
    assert [r.hash_ids for r in select(TRACE, max_blocks=2)][2] == (0, 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ConfigError, match="not a Mooncake trace line"):
        load_trace(bad)
    with pytest.raises(ConfigError, match="no trace file"):
        load_trace(tmp_path / "missing.jsonl")


def test_unbounded_replay_hits_equal_the_ideal(tiny: LoadedModel, tmp_path: Path) -> None:
    params = TraceParams(block_tokens=BT, memory_fraction=20.0, time_scale=1000.0, model="tiny")
    result = run(params, model=tiny, requests=TRACE, work=tmp_path, show_progress=False)
    hits, total, _ = ideal_hits(TRACE)
    assert result.data["slice"]["ideal_hit_blocks"] == hits
    for summary in result.data["policies"]:
        assert summary["blocks"] == total
        assert summary["hit_blocks"] == hits, summary["policy"]
        # everything fits in memory: no hit comes from disk
        assert summary["hits_by_tier"]["L3"] == 0
        assert summary["prefill_tokens_saved"] == hits * BT
    per_request = [r["hit_blocks"] for r in result.data["requests"][KVSTRATA]]
    assert per_request == [0, 1, 3, 4, 2]
    assert [r["hit_blocks"] for r in result.data["requests"][PLAIN_LRU]] == per_request
    assert [r["hit_blocks"] for r in result.data["requests"][KVSTRATA_EXACT_L1]] == per_request
    # device memory: kvstrata holds these interactive blocks as int8s pages, exact L1 exact
    l1 = {p["policy"]: p["bytes_by_codec"]["L1"] for p in result.data["policies"]}
    assert l1[KVSTRATA].get("int8s", 0) > 0
    assert set(l1[KVSTRATA_EXACT_L1]) == set(l1[PLAIN_LRU]) == {"identity"}
    notes = result.tables[0].notes
    assert any(n.startswith(f"{KVSTRATA} against {PLAIN_LRU}: TTFT P50") for n in notes)


def test_token_map_avoids_special_tokens(tiny: LoadedModel) -> None:
    tokens = token_map_for(tiny, BT, 0)
    assert tokens.low > max(tiny.tokenizer.all_special_ids)
    assert tokens.high <= tiny.model.config.vocab_size


def test_cli_json_and_plot(tiny: LoadedModel, tmp_path: Path) -> None:
    from kvstrata.cli.main import app

    trace = write_trace(tmp_path / "t.jsonl", TRACE * 2)
    png = tmp_path / "trace.png"
    args = ["bench", "trace", "--model", "tiny", "--trace", str(trace), "--block-tokens", str(BT)]
    args += ["--sample-every", "1", "--memory-fraction", "0.3", "--time-scale", "1000"]
    args += ["--json", "--plot", str(png)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["suite"] == "trace"
    assert [p["policy"] for p in data["data"]["policies"]] == [KVSTRATA, KVSTRATA_EXACT_L1, PLAIN_LRU]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_input(tmp_path: Path) -> None:
    from kvstrata.cli.main import app

    result = CliRunner().invoke(app, ["bench", "trace", "--trace", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 1
    assert "no trace file" in result.output
    result = CliRunner().invoke(app, ["bench", "trace", "--memory-fraction", "0"])
    assert result.exit_code == 1
    assert "must be positive" in result.output
    result = CliRunner().invoke(app, ["bench", "trace", "--repeats", "0"])
    assert result.exit_code == 1 and "--repeats must be positive" in result.output
    result = CliRunner().invoke(app, ["bench", "trace", "--warmup", "-1"])
    assert result.exit_code == 1 and "--warmup must be 0 or more" in result.output
    result = CliRunner().invoke(app, ["bench", "trace", "--interleave", "-1"])
    assert result.exit_code == 1 and "--interleave must be 0 or more" in result.output


def test_repeats_rotate_the_order_after_an_untimed_warmup(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstrata.bench.trace import runner

    calls: list[tuple[str, int, int, int]] = []
    turns: list[tuple[str, int]] = []  # (policy, requests replayed by the end of its turn)
    real = runner.replaying

    def spy(model, layout, requests, token_map, policy, root, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((policy, len(requests), kwargs["repeat"], kwargs["turn"]))
        replay = real(model, layout, requests, token_map, policy, root, **kwargs)
        done = 0
        while True:
            try:
                next(replay)
            except StopIteration as stop:
                turns.append((policy, len(stop.value.requests) - done))
                return stop.value
            done += kwargs["turn"]
            turns.append((policy, kwargs["turn"]))
            yield

    monkeypatch.setattr(runner, "replaying", spy)
    params = TraceParams(
        block_tokens=BT,
        memory_fraction=20.0,
        time_scale=1000.0,
        model="tiny",
        policies=TWO,
        repeats=2,
        warmup=2,
        interleave=2,
    )
    result = run(params, model=tiny, requests=TRACE, work=tmp_path, show_progress=False)
    # two warm-up requests under each policy (whole, one after the other), then the slice twice,
    # the policies taking turns of two requests, the order rotated each round and each repeat
    n = len(TRACE)
    warmup = [(KVSTRATA, 2, 0, 0), (PLAIN_LRU, 2, 0, 0)]
    assert calls == [
        *warmup,
        (KVSTRATA, n, 0, 2),
        (PLAIN_LRU, n, 0, 2),
        (PLAIN_LRU, n, 1, 2),
        (KVSTRATA, n, 1, 2),
    ]
    k, lru = KVSTRATA, PLAIN_LRU
    first = [(k, 2), (lru, 2), (lru, 2), (k, 2), (k, 1), (lru, 1)]
    second = [(lru, 2), (k, 2), (k, 2), (lru, 2), (lru, 1), (k, 1)]
    assert turns == [(k, 2), (lru, 2), *first, *second]
    hits, _, _ = ideal_hits(TRACE)
    for summary in result.data["policies"]:
        # every replay starts on a fresh store (the warm-up's thrown away): the hits twice over
        assert summary["requests"] == 2 * n and summary["hit_blocks"] == 2 * hits, summary["policy"]
    assert [r["repeat"] for r in result.data["requests"][KVSTRATA]] == [0] * n + [1] * n
    assert [r["hit_blocks"] for r in result.data["requests"][KVSTRATA]] == [0, 1, 3, 4, 2] * 2
    assert [sorted(repeat) for repeat in result.data["repeats"]] == [sorted(TWO)] * 2
    (paired,) = [
        note for note in result.tables[0].notes if note.startswith(f"{KVSTRATA}, each replay against")
    ]
    assert paired.count("x / ") == 2 and "faster in " in paired and f" of {2 * n}" in paired
    assert any("taking turns of 2 requests" in note for note in result.tables[0].notes)
    assert not [*tmp_path.glob("store-*"), *tmp_path.glob("warmup-*")]  # the stores removed


def bounded_replay(tiny: LoadedModel, tmp_path: Path) -> dict[str, dict[str, object]]:
    params = TraceParams(
        block_tokens=BT, memory_fraction=0.3, time_scale=1000.0, l3_budget=0.5, model="tiny", policies=TWO
    )
    result = run(params, model=tiny, requests=TRACE, work=tmp_path, show_progress=False)
    unique = result.data["slice"]["unique_kv_bytes"]
    assert result.data["slice"]["l3_budget_bytes"] == int(unique * 0.5)
    assert len(result.tables) == 3  # the bounded L3's table
    return {p["policy"]: p for p in result.data["policies"]}


def test_bounded_l3_reports_writes_and_checks_the_kept_sessions(tiny: LoadedModel, tmp_path: Path) -> None:
    for name, summary in bounded_replay(tiny, tmp_path).items():
        writes, sessions = summary["writes"], summary["sessions"]
        assert set(writes) >= {"failed_requests", "write_failures", "l3_evictions", "l3_budget_bytes"}
        # two conversations (second block ids 1 and 3): the last turn of each is kept, unless it failed
        assert sessions["conversations"] == 2
        assert (
            sessions["kept"]
            == 2
            - sum(
                1
                for failure in [writes["first_failure"]]
                if failure and failure.startswith(("request 3", "request 4"))
            )
            or writes["failed_requests"] > 0
        )
        # every kept session loads whole or cut at a missing block: never an error
        assert sessions["readable"] + sessions["recompute"] == sessions["kept"], name
        assert sessions["errors"] == 0, sessions["first_error"]
        assert summary["requests"] + writes["failed_requests"] == len(TRACE)
        # a failed request's blocks count as misses: the ratio stays over the whole slice
        assert summary["blocks"] == sum(len(r.hash_ids) for r in TRACE)


# Many short conversations over one shared first block: half the slice's unique KV holds any one
# of them, but not all, so the bounded L3 must evict to keep going (the slice above is too small:
# its longest request alone is larger than half its unique KV).
TRACE_MANY = [TraceRequest(100 * i, 800, 10, (0, i)) for i in range(1, 9)]


def test_bounded_l3_evicts_and_never_fails_a_write(tiny: LoadedModel, tmp_path: Path) -> None:
    params = TraceParams(
        block_tokens=BT, memory_fraction=0.3, time_scale=1000.0, l3_budget=0.5, model="tiny", policies=TWO
    )
    result = run(params, model=tiny, requests=TRACE_MANY, work=tmp_path, show_progress=False)
    for summary in result.data["policies"]:
        name, writes, sessions = summary["policy"], summary["writes"], summary["sessions"]
        assert writes["failed_requests"] == 0, (name, writes["first_failure"])
        assert writes["write_failures"] == 0, name
        assert writes["l3_evictions"] > 0, name  # the budget was reached and room made
        assert sessions["readable"] + sessions["recompute"] == sessions["kept"], name
        assert sessions["errors"] == 0, sessions["first_error"]
