"""Device memory holds each class's blocks in its precision (issue 33): capacity per codec through
``store.stats()``, the same budget holding more blocks of lossy classes, restores that copy pages
as they are into a cache that attends to them where they lie, and the refusal of a ladder whose
L1 codec attention cannot read."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstrata.codecs import CodecId, get_codec
from kvstrata.config import StoreConfig
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.cache import KVStrataCache, PagedLayer, cache_for
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy.grades import GradedCodecs
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.store import KVStore
from kvstrata.store.block import KVBlock
from kvstrata.tiering import TierLevel

from conftest import token_kv

Factory = Callable[..., KVStore]
BF16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=64)
FP32 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_tokens=64)
POOL = CodecLadder(recent_blocks=1)  # the defaults: realtime exact, interactive int8s, background kivi4
EXACT_L1 = CodecLadder(Rung(), Rung("int8", "int8"), Rung("kivi4", "kivi4"), recent_blocks=1)


def _fill(store: KVStore, priority: str, sessions: int, blocks: int, layout: KVLayout) -> None:
    for s in range(sessions):
        session = store.create_session(f"{priority}-{s}", priority=priority)
        tokens = [(s * 131 + i) % 997 for i in range(blocks * layout.block_tokens)]
        store.append(session, tokens, token_kv(layout, tokens))
    store.flush()
    store.tiered.reencoder.flush()


def _l1(store: KVStore) -> object:
    return next(t for t in store.stats().tiers if t.tier == "L1")


@pytest.mark.parametrize(
    ("priority", "codec", "least"), [("interactive", "int8s", 1.9), ("background", "kivi4", 3.2)]
)
@pytest.mark.parametrize("layout", [BF16, FP32], ids=["bf16", "fp32"])
def test_l1_holds_a_lossy_class_in_its_codec_and_stats_say_so(
    open_store: Factory, priority: str, codec: str, least: float, layout: KVLayout
) -> None:
    store = open_store(
        layout=layout, ladder=POOL, l1_budget_bytes=64 * layout.bytes_per_block, l2_budget_bytes=0
    )
    _fill(store, priority, sessions=2, blocks=6, layout=layout)
    tier = _l1(store)
    # every block out of a window is held encoded (2 sessions x 5), the two newest blocks exact;
    # KIVI keeps the sequence's first tokens verbatim, no pages: each first block is int8s there
    want = {codec: 10, "identity": 2} if codec == "int8s" else {codec: 8, "int8s": 2, "identity": 2}
    assert tier.blocks_by_codec == want  # type: ignore[attr-defined]
    per_block = tier.bytes_by_codec[codec] / tier.blocks_by_codec[codec]  # type: ignore[attr-defined]
    sixteen_bit = layout.bytes_per_block // layout.itemsize * 2
    assert sixteen_bit / per_block >= least  # the capacity goal, per block
    assert layout.bytes_per_block / per_block == pytest.approx(sixteen_bit / per_block * layout.itemsize / 2)


@pytest.mark.parametrize("layout", [BF16, FP32], ids=["bf16", "fp32"])
def test_l1_holds_kvmix_blocks_over_five_times_smaller_than_16_bit_ones(
    open_store: Factory, layout: KVLayout
) -> None:
    ladder = CodecLadder(background=Rung("kivi4", "kivi4", "kvmix"), recent_blocks=1)
    store = open_store(
        layout=layout, ladder=ladder, l1_budget_bytes=64 * layout.bytes_per_block, l2_budget_bytes=0
    )
    _fill(store, "background", sessions=2, blocks=6, layout=layout)
    tier = _l1(store)
    # the first blocks hold the sinks verbatim (int8s there, as for KIVI), the newest stay exact
    assert tier.blocks_by_codec == {"kvmix": 8, "int8s": 2, "identity": 2}  # type: ignore[attr-defined]
    per_block = tier.bytes_by_codec["kvmix"] / 8  # type: ignore[attr-defined]
    assert per_block == layout.num_layers * layout.num_kv_heads * 3008
    assert layout.bytes_per_block // layout.itemsize * 2 / per_block >= 5.0


@pytest.mark.parametrize(("priority", "least"), [("interactive", 1.9), ("background", 3.2)])
def test_one_budget_keeps_more_blocks_of_a_lossy_class_resident(
    open_store: Factory, tmp_path: object, priority: str, least: float
) -> None:
    """The same sessions through the same L1 budget (16-bit exact blocks: 40 fit): with each class
    in its codec, at least the goal's multiple of blocks stays resident (the watermarks at the top:
    blocks leave only when a put finds device memory full, so both hold what fits). No idle timer:
    on a loaded machine a fill outlasts L1's 30 s idle age and the demoter's thread then took
    blocks out at its own time (71 against 38 resident were seen); what stays is then only what
    the puts decide."""
    budget = 40 * BF16.bytes_per_block
    counts = {}
    exact_l1 = CodecLadder(Rung(), Rung("int8", "int8"), Rung("kivi4", "kivi4"), recent_blocks=0)
    for name, ladder in (("pool", CodecLadder(recent_blocks=0)), ("exact", exact_l1)):
        root = tmp_path / name  # type: ignore[operator]
        store = open_store(
            root,
            BF16,
            ladder=ladder,
            l1_budget_bytes=budget,
            l2_budget_bytes=0,
            high_watermark=1.0,
            low_watermark=0.99,
            l1_idle_demote_s=None,
            l2_idle_demote_s=None,
        )
        _fill(store, priority, sessions=20, blocks=10, layout=BF16)
        store.tiered.demoter.wait_idle()
        counts[name] = _l1(store).blocks  # type: ignore[attr-defined]
        store.close()
    assert counts["exact"] == 40  # the budget full of 16-bit blocks
    assert counts["pool"] >= least * counts["exact"]


def test_turns_leave_no_replaced_tails_in_device_memory(open_store: Factory) -> None:
    """Each turn of an agent writes a new tail; the one it replaces leaves memory once L3 holds
    it (it was kept exact and protected like the recent window: 44 of 57 blocks after these 12
    turns of 4 agents). A fork that shares a replaced tail still reads it, from L3."""
    store = open_store(
        layout=FP32, ladder=POOL, l1_budget_bytes=200 * FP32.bytes_per_block, l2_budget_bytes=0
    )
    agents = [store.create_session(f"a{i}", priority="interactive") for i in range(4)]
    fork = None
    for turn in range(12):
        for i, session in enumerate(agents):
            tokens = [(i * 7 + turn * 13 + j) % 997 for j in range(35)]
            store.append(session, tokens, token_kv(FP32, tokens, session.num_tokens))
            store.checkpoint(session)
        if turn == 5:
            fork = store.fork(agents[0], "fork")
            forked_tokens = list(agents[0].token_ids)
    store.flush()
    store.tiered.reencoder.flush()
    named = {key for session in agents for key in session.all_keys()}
    held = list(store.tiered.tier(TierLevel.L1).keys())
    assert set(held) <= named | set(fork.all_keys())  # type: ignore[union-attr]
    assert len(held) == len(named)  # the fork's own tail was replaced in memory, not on disk
    loaded = store.load(fork)  # type: ignore[arg-type]
    assert loaded.num_tokens == len(forked_tokens)  # every block found, the replaced tail from L3
    # the interactive class holds int8 below device memory and int8s in it: close, not equal
    assert torch.allclose(loaded.kv, token_kv(FP32, forked_tokens), atol=0.05)  # type: ignore[arg-type]
    tail = agents[1].tail_key
    assert tail is not None and store.tiered.tier(TierLevel.L1).contains(tail)
    store.delete_session("a1")  # a deleted session's tail goes too (it never appends again)
    assert not store.tiered.tier(TierLevel.L1).contains(tail)


def test_a_restore_copies_pages_as_they_are_and_the_cache_attends_to_them_in_place(
    open_store: Factory,
) -> None:
    store = open_store(layout=FP32, ladder=POOL, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0)
    _fill(store, "interactive", sessions=1, blocks=4, layout=FP32)
    session = store.session("interactive-0")
    held = {k: store.tiered.tier(TierLevel.L1).codec_of(k) for k in session.block_keys}
    assert list(held.values()) == [CodecId.INT8S] * 3 + [CodecId.IDENTITY]
    hits = store.counters.of(TierLevel.L1).hits
    cache = cache_for(store, session, extra_tokens=8)
    assert cache.get_seq_length() == 256 and cache.loaded is not None
    assert cache.loaded.tokens_by_tier == {TierLevel.L1: 256}
    assert store.counters.of(TierLevel.L1).hits == hits + 4
    assert cache.pages is not None and len(cache.pages) == 3 and cache.pages.tokens == 192
    assert all(isinstance(layer, PagedLayer) and layer.length == 64 for layer in cache.layers)
    l1 = store.tiered.tier(TierLevel.L1)
    for i, key in enumerate(session.block_keys[:3]):  # the same bytes device memory holds
        _, pages, _ = l1.pages(key)  # type: ignore[attr-defined]
        assert torch.equal(cache.pages.block_pages(i).reshape(-1), pages)
    # the whole KV, as the encoded blocks decode, and the exact window as appended
    want = token_kv(FP32, [i % 997 for i in range(256)])
    got = cache.new_kv(0, 256)
    assert torch.equal(got[:, :, :, 192:], want[:, :, :, 192:])
    assert (got[:, :, :, :192] - want[:, :, :, :192]).abs().max() < 0.05


def test_pages_that_would_be_a_minority_of_a_prefill_are_decoded_with_the_rest(open_store: Factory) -> None:
    """Pages are kept where they hold at least half the tokens a prefill attends to (the prefix
    and the prompt's tokens after it); a few in front of many exact tokens are decoded at the
    restore instead, to the same values: the prefill would copy the exact tokens behind them at
    every layer. The tokens to generate do not count (decode reads pages where they lie)."""
    store = open_store(layout=FP32, ladder=POOL, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0)
    _fill(store, "interactive", sessions=1, blocks=4, layout=FP32)
    session = store.session("interactive-0")
    kept = store.load(session, paged=True, prefill=128)  # 192 paged tokens of 256 + 128: half
    assert kept.pages is not None and kept.pages.tokens == 192
    hits = store.counters.of(TierLevel.L1).hits
    decoded = store.load(session, paged=True, prefill=129)  # 192 of 256 + 129: fewer than half
    assert decoded.pages is None and decoded.tokens_by_tier == {TierLevel.L1: 256}
    assert store.counters.of(TierLevel.L1).hits == hits + 4
    caches = [KVStrataCache.from_loaded(loaded, devices=[None] * 2) for loaded in (kept, decoded)]
    assert torch.equal(caches[0].new_kv(0, 256), caches[1].new_kv(0, 256))
    assert cache_for(store, session, extra_tokens=4096).pages is not None


def test_a_shared_prefix_decoded_from_memory_is_attached_not_appended(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stateless request whose shared prefix's pages are too few for its prompt gets the blocks
    decoded, and its session takes them over by key as with pages: appending them again would
    copy their KV only to touch them (they are in device memory already)."""
    from kvstrata.engine.prefix import PrefixLoader

    store = open_store(layout=FP32, ladder=POOL, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0)
    _fill(store, "interactive", sessions=1, blocks=4, layout=FP32)
    prompt = [i % 997 for i in range(256)] + list(range(5, 305))  # 300 tokens to prefill after them
    appended: list[int] = []
    real_append = store.append
    monkeypatch.setattr(store, "append", lambda s, t, kv: appended.append(len(t)) or real_append(s, t, kv))
    session = store.create_session("stateless", priority="interactive", transient=True)
    prefix = PrefixLoader(store).load(session, prompt, 600, None)
    assert prefix.source is not None and prefix.source.pages is None and appended == []
    assert prefix.num_tokens == session.num_tokens == 256 and prefix.by_tier["L1"] == 256
    assert session.block_keys == store.session("interactive-0").block_keys
    assert prefix.kv is not None
    assert torch.equal(prefix.kv[:, :, :, 192:], token_kv(FP32, prompt[:256])[:, :, :, 192:])


def test_a_realtime_session_restores_exact_without_pages(open_store: Factory) -> None:
    store = open_store(layout=FP32, ladder=POOL, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0)
    _fill(store, "realtime", sessions=1, blocks=4, layout=FP32)
    session = store.session("realtime-0")
    cache = cache_for(store, session)
    assert cache.pages is None and not any(isinstance(layer, PagedLayer) for layer in cache.layers)
    assert isinstance(cache, KVStrataCache)
    want = token_kv(FP32, [i % 997 for i in range(256)])
    assert torch.equal(cache.new_kv(0), want)  # bit for bit


def test_a_ladder_naming_a_codec_that_cannot_sit_in_l1_is_refused_at_start() -> None:
    with pytest.raises(
        ConfigError, match=r"^codec 'sparse' cannot sit in L1 \(device memory, the background class\)"
    ):
        StoreConfig.from_mapping({"ladder": {"background": {"l1": "sparse"}}})


def _graded_blocks(store: KVStore, mass: list[float]) -> list[str]:
    """A background session of 8 blocks, each attended ``mass`` while recent; the codec device
    memory holds each block in."""
    session = store.create_session("graded", priority="background")
    tokens = [i % 997 for i in range(8 * 64)]
    kv = token_kv(FP32, tokens)
    for b in range(8):
        store.append(session, tokens[b * 64 : (b + 1) * 64], kv[:, :, :, b * 64 : (b + 1) * 64])
        store.blocks.add_importance([(session.block_keys[b], mass[b])])
    store.flush()
    store.tiered.reencoder.flush()
    l1 = store.tiered.tier(TierLevel.L1)
    held = [CodecId(l1.codec_of(k)).name.lower() for k in session.block_keys]  # type: ignore[arg-type]
    return held


def test_one_agents_blocks_are_held_by_grade_sinks_and_recent_exact(open_store: Factory) -> None:
    """A graded background rung: each block leaving the window is held by its grade among the
    session's older blocks (attention mass received while it was recent); the first block (the
    attention sinks) and the newest stay exact."""
    grades = GradedCodecs("int8s", "kivi4", "kivi2", top_share=0.2, bottom_share=0.4)
    ladder = CodecLadder(background=Rung("kivi4", "kivi4", "graded"), recent_blocks=1, grades=grades)
    store = open_store(
        layout=FP32, ladder=ladder, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0
    )
    # what each block receives while recent
    held = _graded_blocks(store, [0.05, 0.9, 0.01, 0.5, 0.02, 0.4, 0.03, 0.3])
    assert held[0] == "identity" and held[-1] == "identity"  # sinks, recent window
    assert held[1] == "int8s" and held[2] == "kivi2"  # the most and the least attended
    assert len(set(held)) == 4  # exact, int8s, kivi4, kivi2: one agent at four precisions
    counts = _l1(store).blocks_by_codec  # type: ignore[attr-defined]
    assert sum(counts.values()) == 8 and set(counts) == {"identity", "int8s", "kivi4", "kivi2"}


def test_the_default_graded_rung_holds_the_top_block_kivi4_and_the_rest_kvmix(open_store: Factory) -> None:
    ladder = CodecLadder(background=Rung("kivi4", "kivi4", "graded"), recent_blocks=1)
    store = open_store(
        layout=FP32, ladder=ladder, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0
    )
    held = _graded_blocks(store, [0.05, 0.01, 0.02, 0.9, 0.04, 0.03, 0.2, 0.3])
    # the sinks' block and the recent window exact, the most attended of 7 older blocks KIVI-4
    assert held == ["identity", "kvmix", "kvmix", "kivi4", "kvmix", "kvmix", "kvmix", "identity"]


def test_a_session_raised_to_realtime_attends_exact_kv_with_nothing_recomputed(open_store: Factory) -> None:
    """A background session whose class keeps an exact L3 copy (upgradable): raised to realtime,
    its lossy blocks in device memory are replaced by the exact ones before its next request,
    which then restores every block exact from device memory."""
    ladder = CodecLadder(background=Rung("kivi4", "identity", "kivi4"), recent_blocks=1)
    store = open_store(
        layout=FP32, ladder=ladder, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0
    )
    _fill(store, "background", sessions=1, blocks=4, layout=FP32)
    session = store.session("background-0")
    l1 = store.tiered.tier(TierLevel.L1)
    assert [l1.codec_of(k) for k in session.block_keys] == [CodecId.INT8S, CodecId.KIVI4, CodecId.KIVI4, 0]
    assert store.set_priority(session, "realtime") == (3, 0)
    assert [l1.codec_of(k) for k in session.block_keys] == [CodecId.IDENTITY] * 4  # no lossy block left
    assert store.session("background-0").priority == "realtime"
    cache = cache_for(store, session)
    assert cache.pages is None and cache.loaded is not None and cache.loaded.missing_from_token is None
    assert cache.loaded.tokens_by_tier == {TierLevel.L1: 256}  # nothing recomputed, nothing read below
    assert torch.equal(cache.new_kv(0), token_kv(FP32, [i % 997 for i in range(256)]))  # bit for bit
    assert store.set_priority(session, "background") == (0, 0)  # lowering changes nothing stored


def test_exact_kv_written_for_blocks_held_lossy_replaces_device_memorys_copies(open_store: Factory) -> None:
    """A realtime session that recomputes a background session's lossy blocks (no exact copy
    anywhere) writes them exact under the same keys: device memory's lossy copies go with L3's
    (before, L1 kept its int8s / KIVI-4 copies and only L2 and L3 were replaced)."""
    store = open_store(layout=FP32, ladder=POOL, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0)
    _fill(store, "background", sessions=1, blocks=4, layout=FP32)
    keys = store.session("background-0").block_keys
    l1 = store.tiered.tier(TierLevel.L1)
    assert [l1.codec_of(k) for k in keys] == [CodecId.INT8S, CodecId.KIVI4, CodecId.KIVI4, 0]
    tokens = [i % 997 for i in range(256)]
    realtime = store.create_session("rt", priority="realtime")
    store.append(realtime, tokens, token_kv(FP32, tokens))
    store.flush()
    assert realtime.block_keys == keys  # the same blocks, now exact everywhere
    assert [l1.codec_of(k) for k in keys] == [CodecId.IDENTITY] * 4
    assert {store.disk.codec_of(k) for k in keys} == {CodecId.IDENTITY}
    loaded = store.load(realtime)
    assert loaded.missing_from_token is None and loaded.tokens_by_tier == {TierLevel.L1: 256}
    assert torch.equal(loaded.kv, token_kv(FP32, tokens))  # type: ignore[arg-type]


def test_a_block_appended_again_while_only_on_disk_is_placed_in_memory(open_store: Factory) -> None:
    """The KV in hand of a block stored only below memory (a session's tail written again after
    a recompute, a prefix demoted and computed again) is placed in device memory, as an access:
    before, the append only touched it, and the next restore read it from disk."""
    store = open_store(
        layout=FP32, ladder=CodecLadder.exact(), l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0
    )
    tokens = [i % 997 for i in range(160)]  # two full blocks and a tail
    first = store.create_session("first", priority="realtime")
    store.append(first, tokens, token_kv(FP32, tokens))
    store.checkpoint(first)
    keys = first.all_keys()
    store.blocks.demote_from_l1(keys)
    store.blocks.wait_demotions()
    store.flush()
    assert all(store.blocks.where(k) is not TierLevel.L1 and store.disk.contains(k) for k in keys)
    again = store.create_session("again", priority="realtime")
    store.append(again, tokens, token_kv(FP32, tokens))
    assert again.all_keys() == keys
    assert all(store.blocks.where(k) is TierLevel.L1 for k in keys)
    loaded = store.load(again)
    assert loaded.tokens_by_tier == {TierLevel.L1: 160} and torch.equal(loaded.kv, token_kv(FP32, tokens))  # type: ignore[arg-type]


def test_a_slot_made_in_inference_mode_takes_a_block_outside_it(open_store: Factory) -> None:
    """Device memory's slots outlive their blocks: one made while the step thread runs in inference
    mode takes the next block of its size put by another thread (the prefetcher) outside it."""
    store = open_store(layout=FP32, ladder=POOL, l1_budget_bytes=2 * FP32.bytes_per_block, l2_budget_bytes=0)
    l1 = store.tiered.tier(TierLevel.L1)
    kv = token_kv(FP32, list(range(64)))
    first, second = (
        KVBlock(BlockKey(bytes([i]) * 32), 64, 64, kv.clone()).reencoded(get_codec("int8s"), FP32)
        for i in (1, 2)
    )
    with torch.inference_mode():
        assert l1.put(first)
    assert l1.remove(first.key)
    assert l1.put(second)  # the freed slot, reused: its pages copied in (refused on main)
    assert l1.codec_of(second.key) == CodecId.INT8S
    want = second.decoded(FP32)
    assert torch.equal(l1.get(second.key).decoded(FP32), want)  # type: ignore[union-attr]


def test_attach_extends_a_session_by_stored_blocks_without_their_kv(open_store: Factory) -> None:
    """``store.attach``: a session takes over whole blocks the store holds (a shared prefix whose
    pages a restore kept encoded: there is no KV to append); it refuses, changing nothing, where it
    cannot: the session ends in a partial block, the tokens are not whole blocks, a block is gone."""
    store = open_store(layout=FP32, ladder=POOL, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0)
    _fill(store, "interactive", sessions=1, blocks=4, layout=FP32)
    owner = store.session("interactive-0")
    tokens = [i % 997 for i in range(256)]
    taker = store.create_session("taker", priority="interactive")
    assert store.attach(taker, tokens[:192])
    assert taker.block_keys == owner.block_keys[:3] and taker.token_ids == tokens[:192]
    assert taker.tail_key is None
    cache = cache_for(store, taker)  # its blocks are the owner's int8s pages, attended where they lie
    assert cache.pages is not None and cache.pages.tokens == 192
    want = token_kv(FP32, tokens[:192])
    assert (cache.new_kv(0, 192) - want).abs().max() < 0.05
    store.checkpoint(taker)  # its row names the blocks: they are durable and pinned by it
    assert store.delete_session("interactive-0")
    assert store.load(store.session("taker")).num_tokens == 192

    def refused(session_id: str, attempt: list[int]) -> None:
        session = store.session(session_id)
        before = (list(session.block_keys), list(session.token_ids), session.tail_key)
        assert not store.attach(session, attempt)
        assert (session.block_keys, session.token_ids, session.tail_key) == before

    refused("taker", [1, 2, 3])  # not whole blocks
    refused("taker", [(7 * i) % 991 for i in range(64)])  # a block stored nowhere
    tailed = store.create_session("tailed", priority="interactive")
    store.append(tailed, tokens[:10], token_kv(FP32, tokens[:10]))
    refused("tailed", tokens[10:74])  # it ends in a partial block


def test_a_new_session_on_a_shared_prefix_keeps_its_pages_and_copies_no_kv(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stateless request (a new session) whose prompt starts with blocks another session stored:
    the engine's prefix loader restores device memory's int8s blocks as pages (attended where they
    lie, not decoded) and attaches the blocks to the session with no KV copied; where attaching
    fails (a block went meanwhile), they are decoded and appended as before."""
    from kvstrata.engine.prefix import PrefixLoader

    store = open_store(layout=FP32, ladder=POOL, l1_budget_bytes=64 * FP32.bytes_per_block, l2_budget_bytes=0)
    _fill(store, "interactive", sessions=1, blocks=4, layout=FP32)
    prompt = [i % 997 for i in range(256)] + [5, 6, 7]
    appended: list[int] = []
    real_append = store.append
    monkeypatch.setattr(store, "append", lambda s, t, kv: appended.append(len(t)) or real_append(s, t, kv))
    session = store.create_session("stateless", priority="interactive", transient=True)
    prefix = PrefixLoader(store).load(session, prompt, 300, None)
    assert prefix.num_tokens == session.num_tokens == 256
    assert prefix.source is not None and prefix.source.pages is not None
    assert prefix.source.pages.tokens == 192 and prefix.kv is not None and prefix.kv.shape[3] == 64
    assert prefix.by_tier["L1"] == 256 and appended == []
    assert session.block_keys == store.session("interactive-0").block_keys
    monkeypatch.setattr(store, "attach", lambda session, token_ids: False)
    other = store.create_session("other", priority="interactive", transient=True)
    prefix = PrefixLoader(store).load(other, prompt, 300, None)
    assert prefix.source is not None and prefix.source.pages is None and appended == [256]
    assert prefix.num_tokens == other.num_tokens == 256
    assert torch.equal(prefix.kv[:, :, :, 192:], token_kv(FP32, prompt[:256])[:, :, :, 192:])
