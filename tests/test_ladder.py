"""The codec ladder: per-priority codecs per tier, the exact recent window, upgrades, archive."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata import ConfigError, GcConfig, KVLayout, KVStore, Priority
from kvstrata.codecs import CodecId
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.store.tiers.base import TierLevel
from kvstrata.store.writer import BackgroundWriter

from conftest import token_kv

Factory = Callable[..., KVStore]
LAYOUT16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_tokens=16)
LADDER = CodecLadder(recent_blocks=1)  # the defaults: realtime exact, interactive int8, background kivi4


def _tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def _l3_codecs(store: KVStore, keys: list) -> list[str]:
    return [CodecId(store.disk.codec_of(k)).name.lower() for k in keys]  # type: ignore[arg-type]


def test_defaults_and_validation() -> None:
    ladder = CodecLadder()
    assert ladder.codec_for(Priority.REALTIME, TierLevel.L3) == "identity"
    assert ladder.codec_for(Priority.INTERACTIVE, TierLevel.L2) == "int8"
    assert ladder.codec_for(Priority.BACKGROUND, TierLevel.L3) == "kivi4"
    # device memory holds each class in its precision: realtime exact, interactive int8s, background KIVI-4
    assert [ladder.codec_for(p, TierLevel.L1) for p in Priority] == ["identity", "int8s", "kivi4"]
    assert ladder.max_loss_rank(Priority.REALTIME) == 0
    # archived blocks come back at archive quality for the classes that get archived
    assert ladder.max_loss_rank(Priority.BACKGROUND) == ladder.max_loss_rank(Priority.INTERACTIVE) == 5
    no_archive = CodecLadder(archived="identity")
    assert no_archive.max_loss_rank(Priority.BACKGROUND) > no_archive.max_loss_rank(Priority.INTERACTIVE) > 0
    assert ladder.archive_codec(Priority.BACKGROUND, pinned=False) == "kivi2"
    assert ladder.archive_codec(Priority.BACKGROUND, pinned=True) is None
    with pytest.raises(ConfigError):
        CodecLadder(interactive=Rung("int8", "nope"))


@pytest.mark.parametrize("codec", ["sparse", "lossless", "int8", "delta"])
def test_a_codec_that_cannot_sit_in_l1_is_refused_in_one_line(codec: str) -> None:
    with pytest.raises(ConfigError) as refused:
        CodecLadder(background=Rung("kivi4", "kivi4", codec))
    message = str(refused.value)
    assert "\n" not in message and f"codec '{codec}'" in message and "L1" in message
    with pytest.raises(ConfigError, match=f"codec '{codec}' cannot sit in L1"):
        CodecLadder.parse({"background": {"l1": codec}})
    assert CodecLadder.parse({"background": {"l1": "kivi2"}}).background == Rung("kivi4", "kivi4", "kivi2")


@pytest.mark.parametrize(
    ("priority", "codec"), [("interactive", "int8"), ("background", "kivi4"), ("realtime", "identity")]
)
def test_blocks_leaving_the_recent_window_are_reencoded_in_l3(
    open_store: Factory, priority: str, codec: str
) -> None:
    store = open_store(layout=LAYOUT16, ladder=LADDER, l1_budget_bytes=0, l2_budget_bytes=0)
    session = store.create_session("s", priority=priority)
    tokens = _tokens(16 * 3 + 5)
    exact = token_kv(LAYOUT16, tokens)
    store.append(session, tokens[:20], exact[:, :, :, :20])
    store.append(session, tokens[20:], exact[:, :, :, 20:])
    store.flush()
    # blocks 0 and 1 left the window; block 2 (the most recent full one) and the tail stay exact
    assert _l3_codecs(store, session.block_keys) == [codec, codec, "identity"]
    assert _l3_codecs(store, [session.tail_key]) == ["identity"]
    loaded = store.load(session)
    assert loaded.num_tokens == len(tokens)
    assert torch.equal(loaded.kv[:, :, :, 32:], exact[:, :, :, 32:])  # type: ignore[index]
    error = (loaded.kv[:, :, :, :32] - exact[:, :, :, :32]).abs().max().item()  # type: ignore[index]
    if codec == "identity":
        assert error == 0
    else:
        assert 0 < error < 0.5
    stats = {t.tier: t for t in store.stats().tiers}
    assert stats["L3"].bytes_by_codec.keys() == {codec, "identity"} or codec == "identity"
    assert stats["L3"].compression_ratio > (1.5 if codec != "identity" else 0.9)


def test_a_deleted_sessions_recent_blocks_go_down_the_ladder(open_store: Factory) -> None:
    """A stateless request's session is deleted right after it: its recent window must not keep
    the blocks exact for good; a block another live session still holds as recent stays exact."""
    store = open_store(layout=LAYOUT16, ladder=LADDER, l1_budget_bytes=0, l2_budget_bytes=0)
    tokens = _tokens(16 * 3)
    exact = token_kv(LAYOUT16, tokens)
    first, second = store.create_session("first"), store.create_session("second")
    store.append(first, tokens, exact)
    store.append(second, tokens, exact)  # the same blocks: block 2 is both sessions' recent one
    store.flush()
    assert _l3_codecs(store, first.block_keys) == ["int8", "int8", "identity"]
    store.delete_session("first")
    store.flush()
    assert _l3_codecs(store, first.block_keys) == ["int8", "int8", "identity"]  # second's window
    store.delete_session("second")
    store.flush()
    assert _l3_codecs(store, first.block_keys) == ["int8", "int8", "int8"]


@pytest.mark.parametrize(
    ("priority", "codec", "in_l1"), [("interactive", "int8", "int8s"), ("background", "kivi4", "kivi4")]
)
def test_a_transient_session_has_no_exact_window(
    open_store: Factory, priority: str, codec: str, in_l1: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stateless request's session (deleted right after it) puts its newest blocks in their
    ladder codecs at once, in memory and in L3, not exact and then again re-encoded (and written
    to L3 a second time) at its deletion; a realtime session's stay exact everywhere."""
    store = open_store(layout=LAYOUT16, ladder=LADDER)
    tokens = _tokens(16 * 3 + 5)
    exact = token_kv(LAYOUT16, tokens)
    session = store.create_session("anon", priority=priority, transient=True)
    assert session.transient and not store.create_session("kept").transient
    store.append(session, tokens, exact)
    store.flush()
    assert _l3_codecs(store, session.block_keys) == [codec] * 3
    assert _l3_codecs(store, [session.tail_key]) == [codec]  # and its tail
    l1 = {t.tier: t for t in store.stats().tiers}["L1"].bytes_by_codec
    assert in_l1 in l1 and l1.get("identity", 0) <= LAYOUT16.bytes_per_block  # the sinks' block at most
    written: list[object] = []
    submit = BackgroundWriter.submit
    monkeypatch.setattr(
        BackgroundWriter, "submit", lambda self, b, **kw: (written.append(b.key), submit(self, b, **kw))[1]
    )
    reencoded = store.counters.reencoded
    store.delete_session("anon")
    store.flush()
    assert _l3_codecs(store, session.block_keys) == [codec] * 3
    assert written == [] and store.counters.reencoded == reencoded  # nothing encoded or written again
    realtime = store.create_session("rt", priority="realtime", transient=True)
    store.append(realtime, _tokens(32, 500), token_kv(LAYOUT16, _tokens(32, 500)))
    store.flush()
    assert _l3_codecs(store, realtime.block_keys) == ["identity", "identity"]


def test_l2_holds_blocks_in_the_ladder_codec(open_store: Factory) -> None:
    store = open_store(
        layout=LAYOUT16, ladder=LADDER, l1_budget_bytes=LAYOUT16.bytes_per_block, l2_budget_bytes=1 << 20
    )
    session = store.create_session("s", priority="interactive")
    tokens = _tokens(16 * 4)
    store.append(session, tokens, token_kv(LAYOUT16, tokens))
    store.flush()
    in_l2 = [k for k in session.block_keys if store.tiered.tier(TierLevel.L2).contains(k)]
    assert in_l2  # demoted from the one-slot L1
    old = [k for k in in_l2 if k != session.block_keys[-1]]
    # int8, or int8s as device memory held it (as lossy: a demotion never re-encodes what is as lossy)
    held = {store.tiered.tier(TierLevel.L2).codec_of(k) for k in old}
    assert old and held <= {CodecId.INT8, CodecId.INT8S}


def test_realtime_session_never_attends_to_lossy_shared_blocks(open_store: Factory) -> None:
    store = open_store(layout=LAYOUT16, ladder=LADDER, l1_budget_bytes=0, l2_budget_bytes=0)
    prefix = _tokens(16 * 3)
    exact = token_kv(LAYOUT16, prefix)
    background = store.create_session("bg", priority="background")
    store.append(background, prefix, exact)
    more = _tokens(16, base=500)
    store.append(background, more, token_kv(LAYOUT16, more, 48))  # a 4th block pushes block 2 out too
    store.flush()
    assert _l3_codecs(store, background.block_keys) == ["kivi4"] * 3 + ["identity"]
    realtime = store.create_session("rt", priority="realtime")
    realtime.token_ids = list(prefix)  # as if the engine matched the shared prefix
    realtime.block_keys = list(background.block_keys[:3])
    loaded = store.load(realtime)
    assert loaded.num_tokens == 0 and loaded.missing_from_token == 0  # lossy blocks count as missing
    assert store.counters.rejected_lossy > 0
    # the realtime agent recomputes and writes exact KV: the shared blocks are upgraded in place
    realtime.token_ids, realtime.block_keys = [], []
    store.append(realtime, prefix, exact)
    store.flush()
    assert _l3_codecs(store, realtime.block_keys) == ["identity"] * 3
    assert realtime.block_keys == background.block_keys[:3]  # still one copy, now exact
    assert torch.equal(store.load(realtime).kv, exact)  # type: ignore[arg-type]
    assert torch.equal(store.load(background).kv[:, :, :, :48], exact)  # type: ignore[index]


def test_gc_archives_idle_blocks_to_the_archive_codec(open_store: Factory, tmp_path: Path) -> None:
    store = open_store(layout=LAYOUT16, ladder=LADDER, l1_budget_bytes=0, l2_budget_bytes=0)
    sessions = {p: store.create_session(p, priority=p) for p in ("background", "realtime")}
    for i, session in enumerate(sessions.values()):
        tokens = _tokens(16 * 2, base=1000 * i)
        store.append(session, tokens, token_kv(LAYOUT16, tokens))
        store.checkpoint(session)
    store.flush()
    report = store.maintenance.collect_garbage(GcConfig(cold_after_s=60), now=time.time() + 3600)
    assert report.blocks_moved_cold == 4
    assert report.blocks_archived == 2  # the background session's blocks; realtime ones stay exact
    assert _l3_codecs(store, sessions["background"].block_keys) == ["kivi2", "kivi2"]
    assert _l3_codecs(store, sessions["realtime"].block_keys) == ["identity", "identity"]
    assert all(store.disk.cache.get(k).cold for s in sessions.values() for k in s.block_keys)
    store.close()
    reopened = open_store(layout=LAYOUT16, ladder=LADDER, l1_budget_bytes=0, l2_budget_bytes=0)
    assert reopened.load(reopened.session("background")).num_tokens == 32
