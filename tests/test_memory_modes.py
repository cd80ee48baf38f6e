"""Lossy memory modes: which blocks are kept, that a pruned session attends exactly to them at
their original positions, and that KV computed over a pruned context is keyed apart from exact KV
(never served to another session, kept across restarts, forks and archives)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvstrata import ConfigError, KVStore, Priority, StoreConfig
from kvstrata.engine import Engine, GenerationRequest
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.keys import LINEAGE_BYTES, root_key, session_chain
from kvstrata.policy.ladder import CodecLadder
from kvstrata.policy.memory import MemoryMode, MemoryModeKind

BT = 16
TEXT = (
    "The river ran past the mill and the mill wheel turned all day while the miller counted sacks "
    "of grain and sang about the harvest and the rain. "
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    return load_model(save_tiny_llama(root / "model", seed=5), cache_dir=root / "cache", progress=False)


@pytest.fixture
def store(tiny: LoadedModel, tmp_path: Path) -> Iterator[KVStore]:
    with KVStore(
        tmp_path / "store",
        tiny.layout(BT),
        model_fingerprint=tiny.fingerprint,
        config=StoreConfig(ladder=CodecLadder.exact()),
    ) as opened:
        yield opened


# -- which blocks are kept ---------------------------------------------------------------------


def test_window_keeps_sinks_and_the_most_recent_blocks() -> None:
    mode = MemoryMode(MemoryModeKind.WINDOW, budget_tokens=6 * BT, sink_blocks=1, recent_blocks=2)
    assert mode.keep(5, BT) is None  # 5 full blocks + the tail fit in 6 blocks
    assert mode.keep(10, BT) == [0, 6, 7, 8, 9]  # one block of the budget is the tail's
    two_sinks = MemoryMode("window", budget_tokens=4 * BT, sink_blocks=2, recent_blocks=1)
    assert two_sinks.keep(10, BT) == [0, 1, 9]


def test_importance_keeps_sinks_recent_and_the_most_attended_blocks() -> None:
    mode = MemoryMode(MemoryModeKind.IMPORTANCE, budget_tokens=6 * BT, sink_blocks=1, recent_blocks=2)
    scores = [9.0, 0.1, 5.0, 0.2, 0.3, 4.0, 0.0, 0.1, 0.0, 0.0]
    # sinks {0}, recent {8, 9}, then the two highest of the rest: 2 (5.0) and 5 (4.0)
    assert mode.keep(10, BT, scores) == [0, 2, 5, 8, 9]
    # ties go to the more recent block
    assert mode.keep(10, BT, [0.0] * 10) == [0, 6, 7, 8, 9]
    # system-prompt blocks are kept before the most attended ones, as far as the budget goes
    assert mode.keep(10, BT, scores, protected=[1, 2, 3]) == [0, 1, 2, 8, 9]
    with pytest.raises(ConfigError, match="score for every block"):
        mode.keep(10, BT, None)


def test_mode_parsing_and_budget_errors() -> None:
    assert MemoryMode.parse("importance:1024") == MemoryMode(MemoryModeKind.IMPORTANCE, 1024)
    assert MemoryMode.parse("window").budget_tokens == 2048
    with pytest.raises(ConfigError, match="invalid memory mode"):
        MemoryMode.parse("fifo:12")
    with pytest.raises(ConfigError, match="need 4"):
        MemoryMode("window", budget_tokens=2 * BT).budget_blocks(BT)


def test_pruned_lineage_keys_differ_from_exact_keys_from_the_first_pruned_block() -> None:
    from kvstrata import KVLayout

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", block_tokens=4)
    root = root_key(b"m", layout, "default")
    tokens = list(range(18))
    exact_keys, exact_tail = session_chain(root, tokens, 4)
    lineage = bytes(range(LINEAGE_BYTES))
    keys, tail = session_chain(root, tokens, 4, lineage, 9)  # token 9 lies in block 2
    assert keys[:2] == exact_keys[:2]
    assert all(a != b for a, b in zip(keys[2:], exact_keys[2:], strict=True))
    assert tail != exact_tail
    other, _ = session_chain(root, tokens, 4, bytes(LINEAGE_BYTES), 9)
    assert other[2:] != keys[2:]  # another session's pruned lineage never shares keys


# -- the engine --------------------------------------------------------------------------------


def reference_continuation(
    tiny: LoadedModel, kv: torch.Tensor, kept_positions: list[int], prompt_ids: list[int], start: int, n: int
) -> list[int]:
    """Greedy tokens after ``prompt_ids[start:]``, attending to the cached tokens ``kept_positions``
    of ``kv`` at their original positions (the reference the pruned engine must match)."""
    model = tiny.model
    cache = DynamicCache(config=model.config)
    index = torch.tensor(kept_positions)
    for layer in range(kv.shape[1]):
        cache.update(kv[0, layer, :, index].unsqueeze(0), kv[1, layer, :, index].unsqueeze(0), layer)
    ids = prompt_ids[start:]
    pos = start
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            positions = torch.arange(pos, pos + len(ids)).unsqueeze(0)
            logits = model(input_ids=torch.tensor([ids]), position_ids=positions, cache=cache, use_cache=True)
            token = int(logits.logits[0, -1].argmax())
            out.append(token)
            pos += len(ids)
            ids = [token]
    return out


def test_window_mode_attends_to_kept_blocks_at_their_positions(tiny: LoadedModel, store: KVStore) -> None:
    mode = MemoryMode("window", budget_tokens=4 * BT, sink_blocks=1, recent_blocks=2)
    engine = Engine(tiny, store, memory_modes={"background": mode})
    first = engine.complete("a", TEXT * 2, max_new_tokens=1, priority="background")
    assert first.attended_tokens is None  # nothing stored yet: nothing to prune
    session = store.session("a")
    assert not session.pruned
    history = store.load(session).kv
    assert history is not None
    prompt = engine.prompt_token_ids(GenerationRequest("a", prompt=TEXT * 2 + " And then"))
    start = session.num_tokens
    assert prompt[:start] == session.token_ids
    full = len(session.block_keys)
    kept = mode.keep(full, BT)
    assert kept is not None and kept == [0, full - 2, full - 1]
    positions = [p for b in kept for p in range(b * BT, (b + 1) * BT)] + list(range(full * BT, start))
    expected = reference_continuation(tiny, history, positions, prompt, start, 6)

    second = engine.complete("a", TEXT * 2 + " And then", max_new_tokens=6, priority="background")
    assert second.cached_tokens == start
    assert second.attended_tokens == len(positions) < start
    assert second.token_ids == expected
    session = store.session("a")
    assert session.pruned and session.lineage_from == start
    assert session.lineage is not None and len(session.lineage) == LINEAGE_BYTES

    # The pruned-context blocks are keyed apart: an exact session with the same text neither
    # matches them nor is served their KV, and answers like a full recompute.
    exact_chain = store.block_key_chain("default", session.token_ids)
    first_pruned = start // BT
    assert session.block_keys[:first_pruned] == exact_chain[:first_pruned]
    assert not set(session.block_keys[first_pruned:]) & set(exact_chain)
    assert len(store.match_prefix("default", session.token_ids)) == first_pruned
    text = TEXT * 2 + " And then" + " Later"
    other = engine.complete("b", text, max_new_tokens=6)
    fresh = engine.complete("c", text, max_new_tokens=6, use_cache=False)
    assert other.token_ids == fresh.token_ids
    assert other.cached_tokens <= first_pruned * BT


def test_pruned_lineage_survives_reopen_fork_and_archive(tiny: LoadedModel, tmp_path: Path) -> None:
    config = StoreConfig(ladder=CodecLadder.exact())
    mode = MemoryMode("window", budget_tokens=4 * BT)
    root = tmp_path / "store"
    with KVStore(root, tiny.layout(BT), model_fingerprint=tiny.fingerprint, config=config) as store:
        engine = Engine(tiny, store, memory_modes={Priority.BACKGROUND: mode})
        engine.complete("a", TEXT * 2, max_new_tokens=1, priority="background")
        prompt2 = TEXT * 2 + " Next"
        second = engine.complete("a", prompt2, max_new_tokens=1, priority="background")
        assert second.attended_tokens is not None
        before = store.session("a")
        archive = store.archives.export_session(before)
    with KVStore(root, model_fingerprint=tiny.fingerprint, config=config) as store:
        again = store.session("a")
        assert (again.lineage, again.lineage_from) == (before.lineage, before.lineage_from)
        assert again.block_keys == before.block_keys and again.tail_key == before.tail_key
        child = store.fork(again, "a-child")
        assert child.lineage == again.lineage
        imported = store.archives.import_session(archive, new_id="a-copy")  # verifies the pruned key chain
        assert imported.lineage == before.lineage and imported.block_keys == before.block_keys
        # the third turn resumes from L3 through the kept blocks only, chaining the lineage on
        engine = Engine(tiny, store, memory_modes={Priority.BACKGROUND: mode})
        resumed_tokens, resumed_keys = again.num_tokens, list(again.block_keys)  # `again` is live
        third = engine.complete("a", prompt2 + " More", max_new_tokens=4, priority="background")
        assert third.cached_tokens == resumed_tokens
        assert third.attended_tokens is not None and third.attended_tokens < third.cached_tokens
        after = store.session("a")
        assert after.lineage == before.lineage and after.block_keys[: len(resumed_keys)] == resumed_keys
        # truncating back before the lineage makes the session exact again
        store.truncate(after, before.lineage_from or 0)
        assert not after.pruned


def test_importance_mode_keeps_the_most_attended_blocks(tiny: LoadedModel, store: KVStore) -> None:
    mode = MemoryMode("importance", budget_tokens=5 * BT, sink_blocks=1, recent_blocks=1)
    with pytest.raises(ConfigError, match="track_importance"):
        Engine(tiny, store, memory_modes={"background": mode})
    engine = Engine(tiny, store, memory_modes={"background": mode}, track_importance=True)
    engine.complete("a", TEXT * 3, max_new_tokens=1, priority="background")
    session = store.session("a")
    scores = [store.blocks.importance(key) for key in session.block_keys]
    assert sum(scores) > 0
    kept = mode.keep(len(session.block_keys), BT, scores)
    assert kept is not None
    tail = session.num_tokens - len(session.block_keys) * BT
    second = engine.complete("a", TEXT * 3 + " Then", max_new_tokens=4, priority="background")
    assert second.attended_tokens == len(kept) * BT + tail
    # interactive sessions have no mode here: they attend to everything
    engine.complete("i", TEXT * 3, max_new_tokens=1)
    assert engine.complete("i", TEXT * 3 + " Then", max_new_tokens=4).attended_tokens is None
