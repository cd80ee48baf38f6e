"""The batched forward pass against the single-request path: rows of different lengths, some
prefilling while others decode, rows joining and leaving, position offsets, sdpa and bf16, the
attention mass per row, and a failed step leaving every row as it was."""

from __future__ import annotations

import pytest
import torch
from batch_reference import ids, prefix_kv, restored, solo_forward, solo_greedy

from kvstrata import ConfigError
from kvstrata.engine.batch import BatchedForward, BatchRow, Segment, StepInterrupted
from kvstrata.integrations.transformers import packed_linear as packed_linear_module
from kvstrata.integrations.transformers.cache import KVStrataCache
from kvstrata.integrations.transformers.importance import ImportanceTracker
from kvstrata.integrations.transformers.model import tiny_llama
from kvstrata.integrations.transformers.packed_linear import (
    Routes,
    bf16_packing_available,
    measure_routes,
    pack_linears,
    pad_fp32_linears,
    rows_bucket,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(5, num_layers=3, hidden=64, heads=4, kv_heads=2)


def test_rows_of_different_lengths_prefilling_and_decoding_in_one_step_match_solo(
    model: torch.nn.Module,
) -> None:
    bf = BatchedForward(model)
    histories = [ids(1, 40), [], ids(2, 7), ids(3, 100)]
    prompts = [ids(11, 9), ids(12, 30), [5], ids(14, 3)]
    steps = 12
    expected = [
        solo_greedy(model, restored(model, h), p, steps) for h, p in zip(histories, prompts, strict=True)
    ]
    rows = [BatchRow(restored(model, h)) for h in histories]
    tokens: list[list[int]] = [[] for _ in rows]
    logits: list[list[torch.Tensor]] = [[] for _ in rows]
    # rows 0 and 1 prefill at step 0; row 1's 30-token prompt in chunks of 12 (its first chunks
    # give no logits); rows 2 and 3 join at step 2 and 3, while the others decode
    pending = [list(p) for p in prompts]
    for step in range(steps + 4):
        segments, members = [], []
        for i, row in enumerate(rows):
            if i >= 2 and step < i:
                continue
            if len(tokens[i]) >= steps:
                continue  # left the batch
            if pending[i]:
                chunk = pending[i][:12] if i == 1 else pending[i]
                pending[i] = pending[i][len(chunk) :]
                segments.append(Segment(row, chunk, logits=not pending[i]))
            else:
                segments.append(Segment(row, [tokens[i][-1]]))
            members.append(i)
        if not segments:
            break
        for i, row_logits in zip(members, bf.forward(segments), strict=True):
            if row_logits is not None:
                logits[i].append(row_logits)
                tokens[i].append(int(row_logits.argmax()))
    for i, (want_tokens, want_logits) in enumerate(expected):
        assert tokens[i] == want_tokens, i
        for got, want in zip(logits[i], want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert rows[i].length == len(histories[i]) + len(prompts[i]) + steps - 1


def test_joining_and_leaving_rows_leave_other_rows_kv_in_place(model: torch.nn.Module) -> None:
    bf = BatchedForward(model)
    a = BatchRow(restored(model, ids(4, 20)))
    bf.forward([Segment(a, [7])])
    buffer = a.cache.layers[0]._key_buffer
    assert buffer is not None
    before = a.cache.new_kv(0).clone()
    b = BatchRow.empty(model)
    bf.forward([Segment(b, ids(5, 16)), Segment(a, [8])])  # b joins
    bf.forward([Segment(b, [9])])  # a pauses
    bf.forward([Segment(a, [10])])  # b leaves
    assert a.cache.layers[0]._key_buffer is buffer  # appended in place, never moved
    torch.testing.assert_close(a.cache.new_kv(0, before.shape[3]), before, atol=0, rtol=0)
    solo = restored(model, ids(4, 20))
    for token in (7, 8):
        solo_forward(model, solo, [token])
    torch.testing.assert_close(
        bf.forward([Segment(a, [11])])[0], solo_forward(model, solo, [10, 11]), atol=ATOL, rtol=0
    )


def test_a_row_with_a_position_offset_keeps_its_original_positions(model: torch.nn.Module) -> None:
    """A pruned prefix (a lossy memory mode dropped the middle of the history): the kept slots are
    at their original positions, the new tokens continue after the full history."""
    bf = BatchedForward(model)
    history = ids(6, 48)
    kv = prefix_kv(model, history)
    kept = torch.cat([kv[:, :, :, :16], kv[:, :, :, 32:]], dim=3)  # 16 tokens dropped
    prompt = ids(7, 5)
    want_tokens, want_logits = solo_greedy(
        model, KVStrataCache.from_kv(kept, model=model), prompt, 6, position_offset=16
    )
    row = BatchRow(KVStrataCache.from_kv(kept, model=model), position_offset=16)
    other = BatchRow(restored(model, ids(8, 10)))
    assert row.next_position == 48 and row.length == 32
    got = bf.forward([Segment(other, [3]), Segment(row, prompt)])[1]
    tokens = []
    for step in range(6):
        assert got is not None
        torch.testing.assert_close(got, want_logits[step], atol=ATOL, rtol=0)
        tokens.append(int(got.argmax()))
        got = bf.forward([Segment(row, [tokens[-1]]), Segment(other, [4 + step])])[0]
    assert tokens == want_tokens


def test_sdpa_attention_rows_match_solo_sdpa() -> None:
    """With sdpa, decode rows take a grouped-query fast path; prefill rows sdpa with a mask."""
    model = tiny_llama(6, num_layers=2)
    model.set_attn_implementation("sdpa")
    bf = BatchedForward(model)
    assert bf.base_attention == "sdpa"
    histories, prompts = [ids(9, 33), [], ids(10, 5)], [ids(19, 4), ids(20, 6), [7]]
    expected = [solo_greedy(model, restored(model, h), p, 6) for h, p in zip(histories, prompts, strict=True)]
    rows = [BatchRow(restored(model, h)) for h in histories]
    got = bf.forward([Segment(r, p) for r, p in zip(rows, prompts, strict=True)])
    for step in range(6):
        for g, (want_tokens, want_logits) in zip(got, expected, strict=True):
            assert g is not None
            torch.testing.assert_close(g, want_logits[step], atol=ATOL, rtol=0)
            assert int(g.argmax()) == want_tokens[step]
        got = bf.forward([Segment(r, [t[step]]) for r, (t, _) in zip(rows, expected, strict=True)])
    assert model.config._attn_implementation == "sdpa"  # restored after the step


@pytest.mark.parametrize(
    ("dtype", "attention"), [(torch.float32, "eager"), (torch.float32, "sdpa"), (torch.bfloat16, "sdpa")]
)
def test_the_direct_llama_step_gives_the_model_forwards_logits_bit_for_bit(
    dtype: torch.dtype, attention: str
) -> None:
    """The written-out step (engine/batch/llama.py, with torch's elementwise operators) against the
    same step through the model's own forward: rows prefilling, decoding and tracking attention,
    over a few steps."""
    model = tiny_llama(9, num_layers=3).to(dtype)
    model.config._attn_implementation = attention
    forwards = [BatchedForward(model, attention), BatchedForward(model, attention, direct_llama=False)]
    assert forwards[0]._llama is not None and forwards[1]._llama is None
    forwards[0]._native_ops = False  # torch's operators; the native ones: test_layer_ops.py
    histories, prompts = [ids(31, 20), [], ids(32, 5)], [ids(33, 7), ids(34, 4), [6]]
    kinds = [{"track_attention": False}, {"track_attention": True}, {"track_attention": False}]
    rows = [
        [BatchRow(restored(model, h), **kind) for h, kind in zip(histories, kinds, strict=True)]
        for _ in forwards
    ]
    feeds = [list(p) for p in prompts]
    for _ in range(4):
        got = [
            bf.forward([Segment(r, f) for r, f in zip(rs, feeds, strict=True)])
            for bf, rs in zip(forwards, rows, strict=True)
        ]
        for direct, own in zip(*got, strict=True):
            assert direct is not None and own is not None
            torch.testing.assert_close(direct, own, atol=0, rtol=0)
        feeds = [[int(logits.argmax())] for logits in got[0]]  # type: ignore[union-attr]
    for direct, own in zip(*rows, strict=True):
        keys = [row.cache.new_kv(0, row.length) for row in (direct, own)]
        torch.testing.assert_close(keys[0], keys[1], atol=0, rtol=0)
    torch.testing.assert_close(rows[0][1].block_mass(4), rows[1][1].block_mass(4), atol=0, rtol=0)


def test_a_model_converted_after_its_linears_were_fused_is_fused_again() -> None:
    """The written-out step fuses q/k/v and gate/up once per layer; a model moved to another dtype
    afterwards (``model.to``, as a benchmark running fp32 then bf16 does) is fused again from its
    converted weights, by a new batched forward and by the one made before (the stale fp32 fused
    linears met bf16 rows: a dtype error)."""
    model = tiny_llama(9, num_layers=2)
    model.config._attn_implementation = "sdpa"
    before = BatchedForward(model, "sdpa")
    before._native_ops = False
    assert before.forward([Segment(BatchRow.empty(model), ids(36, 5))])[0] is not None
    model.to(torch.bfloat16)
    for bf in (before, BatchedForward(model, "sdpa")):
        bf._native_ops = False
        got = bf.forward([Segment(BatchRow.empty(model), ids(36, 5))])[0]
        own = BatchedForward(model, "sdpa", direct_llama=False)
        want = own.forward([Segment(BatchRow.empty(model), ids(36, 5))])[0]
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_models_other_than_llama_run_through_their_own_forward() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=tiny_llama(0).config.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    bf = BatchedForward(model, "eager")
    assert bf._llama is None
    row = BatchRow(restored(model, ids(35, 6)))
    got = bf.forward([Segment(row, [3, 4])])[0]
    want = solo_forward(model, restored(model, ids(35, 6)), [3, 4])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_bf16_rows_stay_close_to_solo_bf16() -> None:
    model = tiny_llama(7, num_layers=2).to(torch.bfloat16)
    bf = BatchedForward(model)
    histories, prompts = [ids(21, 25), ids(22, 3)], [ids(23, 6), [9]]
    rows = [BatchRow(restored(model, h)) for h in histories]
    assert rows[0].cache.layers[0].keys.dtype == torch.bfloat16  # type: ignore[union-attr]
    got = bf.forward([Segment(r, p) for r, p in zip(rows, prompts, strict=True)])
    for h, p, g in zip(histories, prompts, got, strict=True):
        assert g is not None and g.dtype == torch.float32
        want = solo_forward(model, restored(model, h), p)
        # bf16 keeps 8 bits of mantissa: packed and single-row matmuls round differently
        torch.testing.assert_close(g, want, atol=0.05, rtol=0.02)


def test_rows_track_the_attention_mass_their_slots_receive(model: torch.nn.Module) -> None:
    bf = BatchedForward(model)
    history, prompt = ids(24, 40), ids(25, 8)
    tracker = ImportanceTracker(block_tokens=16)
    solo = restored(model, history)
    with tracker.attached(model):
        want = solo_forward(model, solo, prompt)
    row = BatchRow(restored(model, history), track_attention=True)
    untracked = BatchRow(restored(model, ids(26, 12)))
    got = bf.forward([Segment(untracked, [4]), Segment(row, prompt)])[1]
    assert got is not None
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(row.block_mass(16), tracker.block_mass, atol=1e-6, rtol=1e-6)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert abs(row.block_mass(16).sum().item() - layers * heads * len(prompt)) < 1e-6
    assert untracked.attention_mass is None
    with pytest.raises(ConfigError, match="does not track"):
        untracked.block_mass(16)


def test_a_failed_step_leaves_every_row_as_it_was(model: torch.nn.Module) -> None:
    bf = BatchedForward(model)
    rows = [BatchRow(restored(model, ids(27, 10))), BatchRow.empty(model)]

    def fail(*args: object) -> None:
        raise RuntimeError("injected failure in the last layer")

    handle = model.model.layers[-1].mlp.down_proj.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            bf.forward([Segment(rows[0], [3, 4]), Segment(rows[1], [5, 6, 7])])
    finally:
        handle.remove()
    assert [r.length for r in rows] == [10, 0]  # the earlier layers' appends were undone
    assert all(layer.get_seq_length() == 10 for layer in rows[0].cache.layers)
    assert model.config._attn_implementation == "eager"
    got = bf.forward([Segment(rows[0], [3, 4])])[0]
    torch.testing.assert_close(
        got, solo_forward(model, restored(model, ids(27, 10)), [3, 4]), atol=ATOL, rtol=0
    )


def test_bad_steps_are_refused_with_clear_errors(model: torch.nn.Module) -> None:
    bf = BatchedForward(model)
    row = BatchRow.empty(model)
    assert bf.forward([]) == []
    with pytest.raises(ConfigError, match="at least one token"):
        bf.forward([Segment(row, [])])
    with pytest.raises(ConfigError, match="twice"):
        bf.forward([Segment(row, [1]), Segment(row, [2])])
    with pytest.raises(ConfigError, match="past the model's"):
        bf.forward([Segment(BatchRow(KVStrataCache.empty_for(model), position_offset=4095), [1, 2])])
    with pytest.raises(ConfigError, match="layers"):
        bf.forward([Segment(BatchRow(KVStrataCache.from_kv(None, 2)), [1])])
    with pytest.raises(ConfigError, match="position_offset"):
        BatchRow(KVStrataCache.empty_for(model), position_offset=-1)
    assert row.length == 0
    flash = tiny_llama(0)
    flash.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(ConfigError, match="eager or sdpa"):
        BatchedForward(flash)


def test_an_interrupted_step_is_undone_and_asked_before_every_layer() -> None:
    model = tiny_llama(8, num_layers=4)
    bf = BatchedForward(model, attention="sdpa")
    assert bf.base_attention == "sdpa" and model.config._attn_implementation == "eager"
    rows = [BatchRow(restored(model, ids(28, 12))), BatchRow.empty(model)]
    asked: list[int] = []

    def interrupt() -> bool:
        asked.append(len(asked))
        return len(asked) == 2  # give up at the second layer

    with pytest.raises(StepInterrupted):
        bf.forward([Segment(rows[0], [3]), Segment(rows[1], [5, 6, 7])], interrupt)
    assert [r.length for r in rows] == [12, 0]  # every append undone
    assert all(layer.get_seq_length() == 12 for layer in rows[0].cache.layers)
    assert model.config._attn_implementation == "eager"
    asked.clear()

    def never() -> bool:
        asked.append(0)
        return False

    got = bf.forward([Segment(rows[0], [3])], never)
    assert len(asked) == 4  # once per layer
    assert got[0] is not None
    solo = restored(model, ids(28, 12))
    model.set_attn_implementation("sdpa")
    try:
        torch.testing.assert_close(got[0], solo_forward(model, solo, [3]), atol=ATOL, rtol=0)
    finally:
        model.set_attn_implementation("eager")


@pytest.mark.skipif(not bf16_packing_available(), reason="oneDNN without bf16 on this CPU")
def test_packed_bf16_linears_give_the_same_logits_bit_for_bit() -> None:
    model = tiny_llama(9, num_layers=2).to(torch.bfloat16)
    history, prompt = ids(29, 30), ids(30, 5)
    bf = BatchedForward(model)
    rows = [BatchRow(restored(model, history)), BatchRow.empty(model)]
    before = bf.forward([Segment(rows[0], prompt), Segment(rows[1], prompt)])
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linears(model) == linears and pack_linears(model) == 0  # once
    rows = [BatchRow(restored(model, history)), BatchRow.empty(model)]
    after = bf.forward([Segment(rows[0], prompt), Segment(rows[1], prompt)])
    for a, b in zip(before, after, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert pack_linears(tiny_llama(9, num_layers=2)) == 0  # fp32 weights: left as they are


def test_padded_fp32_linears_give_each_row_its_own_result() -> None:
    model = tiny_llama(10, num_layers=1)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pad_fp32_linears(model) == linears and pad_fp32_linears(model) == 0  # once
    layer = model.model.layers[0].mlp.down_proj
    gen = torch.Generator().manual_seed(3)
    for rows in [1, 2, 3, 4, 6, 7, 11, 63, 64, 66]:  # 2 and 3 past a multiple of 4 are padded
        x = torch.randn(1, rows, layer.in_features, generator=gen)
        got = layer(x)
        assert got.shape == (1, rows, layer.out_features)
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        flat = layer(x[0])  # (rows, features) too
        torch.testing.assert_close(flat, want[0], atol=1e-5, rtol=1e-5)
    assert pad_fp32_linears(tiny_llama(10, num_layers=1).to(torch.bfloat16)) == 0  # bf16: packed instead


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_fp32_linears_run_a_few_rows_on_their_packed_weights_and_one_row_on_torchs() -> None:
    model = tiny_llama(10, num_layers=1)
    pad_fp32_linears(model, Routes(one_row=False, chunks=False))
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(1, 8, layer.in_features, generator=torch.Generator().manual_seed(4))
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        layer.weight.zero_()  # the packed copy is not the weight: a few rows still see the old one
    for rows in (2, 3, 8):
        torch.testing.assert_close(layer(x[:, :rows]), want[:, :rows], atol=1e-5, rtol=1e-5)
    assert layer(torch.randn(1, 63, layer.in_features)).abs().sum() > 0
    for rows in (1, 64):  # one row (a lone decode step) and prefill chunks: torch's kernel, the weight
        assert layer(torch.randn(1, rows, layer.in_features)).abs().sum() == 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_one_row_and_prefill_chunks_run_where_the_routes_send_them() -> None:
    for routes in (Routes(one_row=True, chunks=False), Routes(one_row=False, chunks=True)):
        model = tiny_llama(10, num_layers=1)
        pad_fp32_linears(model, routes)
        layer = model.model.layers[0].mlp.down_proj
        x = torch.randn(1, 64, layer.in_features, generator=torch.Generator().manual_seed(5))
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
        with torch.no_grad():
            layer.weight.zero_()  # the packed copy keeps the old weight; torch's kernel sees zeros
        one, chunk = layer(x[:, :1]), layer(x)
        if routes.one_row:
            torch.testing.assert_close(one, want[:, :1], atol=1e-5, rtol=1e-5)
        else:
            assert one.abs().sum() == 0
        if routes.chunks:
            torch.testing.assert_close(chunk, want, atol=1e-5, rtol=1e-5)
        else:
            assert chunk.abs().sum() == 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_routes_are_measured_once_per_weight_shape() -> None:
    measure_routes.cache_clear()
    first = measure_routes(48, 40)
    assert isinstance(first, Routes) and measure_routes(48, 40) is first  # cached: one measurement
    assert measure_routes.cache_info().misses == 1
    model = tiny_llama(10, num_layers=1)
    pad_fp32_linears(model)  # measured for each of the model's shapes
    assert measure_routes.cache_info().currsize > 1


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_packed_kernels_see_a_few_dozen_row_counts_whatever_rows_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """oneDNN and ideep keep a kernel per input shape (about 0.3 MB each, up to 1,024 each): every
    row count a server met grew them by hundreds of megabytes over hours (issue 32's soak)."""
    seen: set[int] = set()
    real = packed_linear_module._LINEAR

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.add(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(packed_linear_module, "_LINEAR", counting)
    model = tiny_llama(10, num_layers=1)
    pad_fp32_linears(model, Routes(one_row=True, chunks=True))
    layer = model.model.layers[0].mlp.down_proj
    gen = torch.Generator().manual_seed(6)
    for rows in range(1, 600):
        x = torch.randn(1, rows, layer.in_features, generator=gen)
        got = layer(x)
        assert got.shape == (1, rows, layer.out_features)
        if rows in (1, 5, 63, 65, 100, 257, 599):
            want = torch.nn.functional.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(seen) <= 40 and max(seen) <= 599 * 5 // 4  # at most a quarter more rows than asked
    assert all(rows_bucket(rows) >= rows for rows in range(2000))
