"""A cache holding some blocks encoded (resident pages): through the HF Cache API (``generate``'s
path, one layer dequantized at a time) and through batched steps (the decode kernel reading them
in place), against a cache holding the same values decoded."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvstrata.codecs import BlockContext, get_codec, pages
from kvstrata.codecs.arena import PageArena
from kvstrata.engine.batch import BatchedForward, BatchRow, Segment, decode_kernel
from kvstrata.integrations.transformers import packed_linear
from kvstrata.integrations.transformers.cache import KVStrataCache, PagedLayer
from kvstrata.integrations.transformers.model import layout_for_config, tiny_llama

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from batch_reference import ids, prefix_kv, solo_greedy

BLOCK = 16
PLAN = [None, "int8s", "kivi4", "kivi2", None]  # per 16-token block: None stays exact


def model_of(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = tiny_llama(40, num_layers=2, hidden=256, heads=4, kv_heads=2).to(dtype)  # head_dim 64
    model.set_attn_implementation("sdpa")
    return model


def paged_and_reference(
    model: torch.nn.Module, history: list[int], plan: list[str | None] = PLAN, extra: int = 16
) -> tuple[KVStrataCache, KVStrataCache]:
    """A cache whose blocks of ``history`` are held as ``plan`` says, and a cache of the same
    values decoded (what the codecs' ``decode`` gives), both with room for ``extra`` tokens."""
    layout = layout_for_config(model.config, model.dtype, block_tokens=BLOCK)
    kv = prefix_kv(model, history)
    arena, decoded, exact = PageArena(layout), kv.clone(), []
    for b in range(-(-kv.shape[3] // BLOCK)):
        block = kv[:, :, :, b * BLOCK : (b + 1) * BLOCK].contiguous()
        name = plan[b] if b < len(plan) else None
        if name is None:
            exact.append(block)
            continue
        record = get_codec(name).encode(block, BlockContext(b * BLOCK))
        spec = pages.page_spec(record, layout)
        assert spec is not None
        arena.add(b * BLOCK, spec, pages.to_pages(record, spec, layout))
        decoded[:, :, :, b * BLOCK : (b + 1) * BLOCK] = get_codec(name).decode(record, layout)
    paged = KVStrataCache.from_kv(torch.cat(exact, dim=3), model=model, extra_tokens=extra, pages=arena)
    return paged, KVStrataCache.from_kv(decoded, model=model, extra_tokens=extra)


@pytest.mark.parametrize("plan", [PLAN, [None, "kvmix", "int8s", "kvmix", None]], ids=["kivi", "kvmix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_path_attends_to_encoded_blocks_as_to_their_decoded_values(
    dtype: torch.dtype, plan: list[str | None]
) -> None:
    model = model_of(dtype)
    history = ids(3, 70)
    paged, reference = paged_and_reference(model, history, plan)
    assert all(isinstance(layer, PagedLayer) for layer in paged.layers)
    assert paged.get_seq_length() == reference.get_seq_length() == 70 and paged.prefix_tokens == 70
    assert paged.pages is not None and paged.pages.tokens == 48
    got_tokens, got_logits = solo_greedy(model, paged, ids(4, 5), 6)
    want_tokens, want_logits = solo_greedy(model, reference, ids(4, 5), 6)
    assert got_tokens == want_tokens
    tolerance = 1e-4 if dtype == torch.float32 else 0.05  # bf16: keys in another order round otherwise
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
    # what a commit takes (the tokens after every block) is sliced as it is; other positions are
    # the encoded blocks' values
    first = 70 - paged.pages.tokens  # the exact tokens hold the positions no block covers
    keys = torch.stack([layer.keys[0, :, first : first + 5] for layer in paged.layers])  # type: ignore[index]
    values = torch.stack([layer.values[0, :, first : first + 5] for layer in paged.layers])  # type: ignore[index]
    assert torch.equal(paged.new_kv(70, 75), torch.stack([keys, values]))
    torch.testing.assert_close(
        paged.new_kv(0, 70).float(), reference.new_kv(0, 70).float(), atol=1e-6, rtol=0
    )


def test_the_layers_dequantize_into_one_scratch_and_a_cache_without_pages_is_exact() -> None:
    model = model_of()
    paged, _ = paged_and_reference(model, ids(5, 50))
    scratch = {id(layer.scratch) for layer in paged.layers if isinstance(layer, PagedLayer)}  # type: ignore[attr-defined]
    assert len(scratch) == 1  # one layer's worth at a time, never the whole context
    plain = KVStrataCache.from_kv(prefix_kv(model, ids(5, 50)), model=model)
    assert plain.pages is None and not any(isinstance(layer, PagedLayer) for layer in plain.layers)


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    module = decode_kernel.load()
    if module is None:
        pytest.skip(f"the native kernel is not available here: {decode_kernel.status()}")
    return module


@pytest.mark.parametrize("with_kernel", [True, False])
def test_batched_rows_with_encoded_blocks_match_their_decoded_values_alone(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, with_kernel: bool
) -> None:
    """Decode rows read their pages in the kernel (or, without it, dequantized); a prefilling row
    dequantizes its layer into the scratch: each row's logits match its reference run alone."""
    model = model_of()
    bf = BatchedForward(model)
    calls: list[int] = []
    if with_kernel:
        request.getfixturevalue("kernel")
        real = decode_kernel.decode_attention
        monkeypatch.setattr(decode_kernel, "decode_attention", lambda *a: calls.append(1) or real(*a))
    else:
        monkeypatch.setattr(decode_kernel, "loaded", lambda: None)
    histories = [ids(6, 70), ids(7, 40), ids(8, 33)]
    plans = [PLAN, ["int8s", "kvmix"], []]
    prompts = [[5], ids(9, 7), [6]]
    caches = [paged_and_reference(model, h, p) for h, p in zip(histories, plans, strict=True)]
    expected = [solo_greedy(model, ref, p, 4) for (_, ref), p in zip(caches, prompts, strict=True)]
    rows = [BatchRow(paged) for paged, _ in caches]
    got = bf.forward([Segment(r, p) for r, p in zip(rows, prompts, strict=True)])
    for step in range(4):
        for g, (want_tokens, want_logits) in zip(got, expected, strict=True):
            assert g is not None
            torch.testing.assert_close(g, want_logits[step], atol=1e-4, rtol=0)
            assert int(g.argmax()) == want_tokens[step]
        got = bf.forward([Segment(r, [t[step]]) for r, (t, _) in zip(rows, expected, strict=True)])
    assert len(calls) == (2 * 5 if with_kernel else 0)  # once per layer and step (rows 0 and 2 first)
    for row, history, prompt in zip(rows, histories, prompts, strict=True):
        assert row.length == len(history) + len(prompt) + 4


def test_the_kernel_adds_up_the_attention_mass_of_encoded_blocks_where_they_lie(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracking decode row's mass, added up in the kernel in attention's order, lands on the
    blocks of the sequence it belongs to: as eager attention gives it over the decoded values."""
    model = model_of()
    bf = BatchedForward(model)
    history = ids(10, 70)
    paged, reference = paged_and_reference(model, history)
    rows = [BatchRow(paged, track_attention=True), BatchRow(reference, track_attention=True)]
    bf.forward([Segment(rows[0], [5])])
    monkeypatch.setattr(decode_kernel, "loaded", lambda: None)  # the reference: eager attention
    bf.forward([Segment(rows[1], [5])])
    got, want = rows[0].block_mass(BLOCK), rows[1].block_mass(BLOCK)
    assert got.shape == want.shape == (5,)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert abs(got.sum().item() - layers * heads) < 1e-4  # each query's probabilities sum to 1


def test_the_native_decode_step_reads_encoded_blocks_as_the_python_loop_does(kernel: ModuleType) -> None:
    """bf16 linears packed: a decode step's layers run in one native call (decode_step.cpp);
    rows holding encoded blocks (one tracking its attention mass) give the loop's logits, KV and
    mass bit for bit."""
    if not packed_linear.bf16_packing_available():
        pytest.skip("oneDNN has no bf16 here: no packed linears")
    model = model_of(torch.bfloat16)
    packed_linear.pack_linears(model)
    native, loop = BatchedForward(model), BatchedForward(model)
    assert loop._llama is not None and native._llama is not None
    loop._llama._native_layers = None
    histories, plans = [ids(11, 70), ids(12, 40)], [PLAN, ["int8s", "kvmix"]]
    rows = [
        [
            BatchRow(paged_and_reference(model, h, p)[0], track_attention=i == 0)
            for i, (h, p) in enumerate(zip(histories, plans, strict=True))
        ]
        for _ in range(2)
    ]
    feeds = [[5], [6]]
    for _ in range(3):
        got = native.forward([Segment(r, f) for r, f in zip(rows[0], feeds, strict=True)])
        want = loop.forward([Segment(r, f) for r, f in zip(rows[1], feeds, strict=True)])
        for g, w in zip(got, want, strict=True):
            assert g is not None and w is not None and torch.equal(g, w)
        feeds = [[int(w.argmax())] for w in want]  # type: ignore[union-attr]
    assert native._llama.native_steps == 3 and loop._llama.native_steps == 0
    for a, b in zip(rows[0], rows[1], strict=True):
        for x, y in zip(a.cache.layers, b.cache.layers, strict=True):
            assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
    assert torch.equal(rows[0][0].block_mass(BLOCK), rows[1][0].block_mass(BLOCK))
