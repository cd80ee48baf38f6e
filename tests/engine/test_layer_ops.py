"""The native elementwise operations of a batched Llama step (layer_ops.cpp) against the torch
operations they replace (engine/batch/llama.py's TorchOps, transformers' code): bfloat16 bit for
bit where torch's own rounding is followed, float32 within its rounding; strided inputs as the
step hands them over; the step with them against the model's own forward; clear refusals."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from batch_reference import ids, restored

from kvstrata.engine.batch import BatchedForward, BatchRow, Segment, decode_kernel
from kvstrata.engine.batch.llama import TorchOps
from kvstrata.integrations.transformers.layer import KVStrataLayer, append_rows
from kvstrata.integrations.transformers.model import tiny_llama


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    module = decode_kernel.load()
    status = decode_kernel.status()
    if module is None:
        if status.startswith("build failed") or status == "building":
            pytest.fail(f"the kernel did not build: {status}")
        pytest.skip(f"the native module is not available here: {status}")
    return module


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, fp32_tol: float = 1e-6) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    else:
        torch.testing.assert_close(got, want, atol=fp32_tol, rtol=fp32_tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_operation_matches_torchs(ops: ModuleType, dtype: torch.dtype) -> None:
    x, w = rand(1, 7, 576, dtype=dtype, seed=1, scale=3.0), rand(576, dtype=dtype, seed=2)
    got = ops.rms_norm(x, w, 1e-5)
    # the sum of squares is added up in another order: float32 rounding, then bfloat16's
    torch.testing.assert_close(got.float(), TorchOps.rms_norm(x, w, 1e-5).float(), atol=2e-2, rtol=1e-2)
    if dtype == torch.float32:
        torch.testing.assert_close(got, TorchOps.rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)

    delta = rand(1, 7, 576, dtype=dtype, seed=3)
    mine, theirs = x.clone(), x.clone()
    normed = ops.add_rms_norm(mine, delta, w, 1e-6)
    want = TorchOps.add_rms_norm(theirs, delta, w, 1e-6)
    torch.testing.assert_close(mine, theirs, atol=0, rtol=0)  # the residual add, in place
    torch.testing.assert_close(normed.float(), want.float(), atol=2e-2, rtol=1e-2)

    qkv = rand(7, 15 * 64, dtype=dtype, seed=5)  # queries and keys, then values: a strided view
    qk = qkv[:, : 12 * 64].view(7, 12, 64)
    cos, sin = rand(7, 64, dtype=dtype, seed=6), rand(7, 64, dtype=dtype, seed=7)
    same(ops.rotate(qk, cos, sin), TorchOps.rotate(qk, cos, sin), dtype, fp32_tol=0)


def test_bad_inputs_are_refused_with_clear_errors(ops: ModuleType) -> None:
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="a weight of the rows' size and dtype"):
        ops.rms_norm(x, torch.randn(32), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(x.double(), torch.randn(64).double(), 1e-5)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotate(torch.randn(2, 3, 64), torch.randn(2, 32), torch.randn(2, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_with_the_native_operations_stays_with_the_models_forward(
    ops: ModuleType, dtype: torch.dtype
) -> None:
    model = tiny_llama(11, num_layers=3).to(dtype)
    model.config._attn_implementation = "sdpa"
    native, own = BatchedForward(model, "sdpa"), BatchedForward(model, "sdpa", direct_llama=False)
    assert native._native_ops
    histories, prompts = [ids(41, 30), []], [ids(42, 5), ids(43, 9)]
    rows = [[BatchRow(restored(model, h)) for h in histories] for _ in range(2)]
    feeds = [list(p) for p in prompts]
    atol, rtol = (1e-4, 0.0) if dtype == torch.float32 else (0.05, 0.02)
    for _ in range(3):
        got = native.forward([Segment(r, f) for r, f in zip(rows[0], feeds, strict=True)])
        want = own.forward([Segment(r, f) for r, f in zip(rows[1], feeds, strict=True)])
        for g, w in zip(got, want, strict=True):
            assert g is not None and w is not None
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
        feeds = [[int(w.argmax())] for w in want]  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_appended_in_one_call_are_as_appended_row_by_row(ops: ModuleType, dtype: torch.dtype) -> None:
    """All rows of a layer appended by the native module: the same buffers and views as one
    append per row, the layers' own view tensors lengthened in place; a full buffer or another
    dtype leaves everything as it was (the caller then appends row by row and grows it)."""
    histories = [5, 0, 63]  # a full buffer after one token: capacity 64
    mine, theirs = [KVStrataLayer() for _ in histories], [KVStrataLayer() for _ in histories]
    for i, n in enumerate(histories):
        keys, values = rand(1, 3, n, 16, dtype=dtype, seed=i), rand(1, 3, n, 16, dtype=dtype, seed=10 + i)
        mine[i].load_prefix(keys, values)
        theirs[i].load_prefix(keys, values)
    views = [(layer.keys, layer.values) for layer in mine]
    packed = rand(4, 2, 3, 16, dtype=dtype, seed=20)  # (tokens, k/v, heads, dim): strided as a step's
    keys, values = (packed[:, j].transpose(0, 1).unsqueeze(0) for j in (0, 1))
    sizes = [1, 2, 1]
    assert append_rows(ops, mine, keys, values, sizes)
    for layer, k, v in zip(theirs, keys.split(sizes, 2), values.split(sizes, 2), strict=True):
        layer.append(k, v)
    for a, b, (k, v) in zip(mine, theirs, views, strict=True):
        assert a.keys is k and a.values is v  # the same tensors, lengthened
        assert a.length == b.length == a.keys.shape[2]
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    before = [(layer.length, layer.keys.clone(), layer.keys.shape) for layer in mine]
    assert not append_rows(ops, mine, keys[:, :, :3], values[:, :, :3], [1, 1, 1])  # row 2 is full
    assert not append_rows(ops, mine[:1], keys[:, :, :1].double(), values[:, :, :1].double(), [1])
    for layer, (length, kept, shape) in zip(mine, before, strict=True):
        assert layer.length == length and layer.keys.shape == shape and torch.equal(layer.keys, kept)
    assert not append_rows(ops, [KVStrataLayer()], keys[:, :, :1], values[:, :, :1], [1])  # empty layer
    with pytest.raises(RuntimeError, match="the sizes add up to the new tokens"):
        append_rows(ops, mine, keys, values, [1, 1, 1])
