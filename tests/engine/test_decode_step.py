"""A decode step's decoder layers in one native call (decode_step.cpp, through
``LlamaStep._decode_layers``) against the Python loop of the same step, bf16 and fp32: the same
logits and the same KV bit for bit; steps it does not take (a prefill, a full buffer) run the loop; an
interrupted step leaves every row as it was; attention mass added up as the loop adds it."""

from __future__ import annotations

import pytest
import torch
from batch_reference import ids, prefix_kv

from kvstrata.engine.batch import BatchedForward, BatchRow, Segment, StepInterrupted, decode_kernel
from kvstrata.integrations.transformers.cache import KVStrataCache
from kvstrata.integrations.transformers.model import tiny_llama
from kvstrata.integrations.transformers.packed_linear import (
    bf16_packing_available,
    pack_linears,
    pad_fp32_linears,
)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    if decode_kernel.load() is None:
        status = decode_kernel.status()
        if status.startswith("build failed") or status == "building":
            pytest.fail(f"the kernel did not build: {status}")
        pytest.skip(f"the native module is not available here: {status}")
    if not torch.backends.mkldnn.is_available() or (
        request.param == torch.bfloat16 and not bf16_packing_available()
    ):
        pytest.skip("no oneDNN for this dtype here: no packed linears")
    model = tiny_llama(23, num_layers=3, hidden=256, heads=4, kv_heads=2).to(request.param)  # head_dim 64
    model.set_attn_implementation("sdpa")
    assert pack_linears(model) + pad_fp32_linears(model) > 0  # as the engine prepares a model
    return model


def forwards(model: torch.nn.Module) -> tuple[BatchedForward, BatchedForward]:
    """The native step, and the same step with its layers left to the Python loop."""
    native, loop = BatchedForward(model, "sdpa"), BatchedForward(model, "sdpa")
    assert native._llama is not None and native._llama._native_layers is not None
    assert loop._llama is not None
    loop._llama._native_layers = None
    return native, loop


def rows_of(model: torch.nn.Module, lengths: list[int], room: int = 8, track: bool = False) -> list[BatchRow]:
    caches = [
        KVStrataCache.from_kv(prefix_kv(model, ids(50 + n, n)), model=model, extra_tokens=room)
        for n in lengths
    ]
    return [BatchRow(cache, track_attention=track) for cache in caches]


def step(
    forward: BatchedForward, rows: list[BatchRow], feeds: list[list[int]], **kwargs: object
) -> list[torch.Tensor]:
    logits = forward.forward([Segment(r, f) for r, f in zip(rows, feeds, strict=True)], **kwargs)  # type: ignore[arg-type]
    assert all(x is not None for x in logits)
    return logits  # type: ignore[return-value]


def same_kv(a: list[BatchRow], b: list[BatchRow]) -> bool:
    return all(
        x.length == y.length == x.keys.shape[2]
        and torch.equal(x.keys, y.keys)
        and torch.equal(x.values, y.values)
        for r, s in zip(a, b, strict=True)
        for x, y in zip(r.cache.layers, s.cache.layers, strict=True)
    )


def test_decode_steps_in_one_native_call_are_the_python_loop_bit_for_bit(model: torch.nn.Module) -> None:
    native, loop = forwards(model)
    lengths = [5, 40, 17, 3, 29]  # five rows: the linears pad them to eight
    mine, theirs = rows_of(model, lengths), rows_of(model, lengths)
    feeds = [[t] for t in ids(7, len(lengths))]
    for _ in range(4):
        got, want = step(native, mine, feeds), step(loop, theirs, feeds)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        assert same_kv(mine, theirs)
        feeds = [[int(w.argmax())] for w in want]
    assert native._llama is not None and native._llama.native_steps == 4
    assert loop._llama is not None and loop._llama.native_steps == 0


def test_a_prefill_or_a_full_buffer_runs_the_python_loop(model: torch.nn.Module) -> None:
    native, loop = forwards(model)
    assert native._llama is not None
    mine, theirs = rows_of(model, [12, 30]), rows_of(model, [12, 30])
    layer = mine[0].cache.layers[0]
    room = layer._key_buffer.shape[2] - layer.length  # type: ignore[union-attr]
    feeds = [ids(8, room), [9]]  # row 0 prefills up to its buffer's end
    for _ in range(3):  # then a step whose row 0 has no room (the loop grows it), then a native one
        for g, w in zip(step(native, mine, feeds), step(loop, theirs, feeds), strict=True):
            assert torch.equal(g, w)
        assert same_kv(mine, theirs)
        feeds = [[4], [5]]
    assert native._llama.native_steps == 1


def test_an_interrupted_native_step_leaves_every_row_as_it_was(model: torch.nn.Module) -> None:
    native, loop = forwards(model)
    assert native._llama is not None
    mine, theirs = rows_of(model, [6, 21]), rows_of(model, [6, 21])
    before = [
        [(layer.length, layer.keys.shape, layer.keys.clone()) for layer in r.cache.layers] for r in mine
    ]
    asked: list[int] = []

    def interrupt() -> bool:
        asked.append(1)
        return len(asked) == 2  # given up before the second layer's attention

    with pytest.raises(StepInterrupted, match="at layer 1"):
        step(native, mine, [[3], [4]], interrupt=interrupt)
    for row, layers in zip(mine, before, strict=True):
        for layer, (length, shape, keys) in zip(row.cache.layers, layers, strict=True):
            assert layer.length == length and layer.keys.shape == shape and torch.equal(layer.keys, keys)
    assert native._llama.native_steps == 0
    for g, w in zip(step(native, mine, [[3], [4]]), step(loop, theirs, [[3], [4]]), strict=True):
        assert torch.equal(g, w)
    assert same_kv(mine, theirs)


def test_attention_mass_is_added_up_as_the_loop_adds_it(model: torch.nn.Module) -> None:
    native, loop = forwards(model)
    mine, theirs = rows_of(model, [9, 33], track=True), rows_of(model, [9, 33], track=True)
    for _ in range(3):
        step(native, mine, [[1], [2]])
        step(loop, theirs, [[1], [2]])
    assert native._llama is not None and native._llama.native_steps == 3
    for a, b in zip(mine, theirs, strict=True):
        got = a.block_mass(16)
        assert got.sum() > 0 and torch.equal(got, b.block_mass(16))
