"""The native decode-attention kernel: against sdpa on shapes at and off its vector width, a row's
result independent of the rows beside it, batched steps with it against the single-request
path, its clear refusals, and the conditions under which it stays off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from batch_reference import ids, restored, solo_forward, solo_greedy

from kvstrata.engine.batch import BatchedForward, BatchRow, Segment, decode_kernel
from kvstrata.integrations.transformers.model import tiny_llama

F = torch.nn.functional


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    module = decode_kernel.load()
    status = decode_kernel.status()
    if module is None:
        if status.startswith("build failed") or status == "building":  # a broken or hung toolchain
            pytest.fail(f"the kernel did not build: {status}")
        pytest.skip(f"the native kernel is not available here: {status}")
    return module


def kv(heads: int, length: int, dim: int, seed: int) -> torch.Tensor:
    """A (1, heads, length, dim) view into a larger buffer, as a row's cache layer holds it."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, length + 7, dim, generator=gen)[:, :, :length]


@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(3, 3, 64), (2, 1, 16), (1, 8, 128), (4, 2, 256)])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa(
    kernel: ModuleType, kv_heads: int, group: int, dim: int, length: int, dtype: torch.dtype
) -> None:
    """In fp32 arithmetic whatever the KV's dtype: against sdpa on the same values in fp32."""
    rows = 3
    query = torch.randn(rows, kv_heads * group, dim, generator=torch.Generator().manual_seed(length))
    query = query.to(dtype)
    keys = [kv(kv_heads, length + r, dim, 10 * r + 1).to(dtype) for r in range(rows)]
    values = [kv(kv_heads, length + r, dim, 10 * r + 2).to(dtype) for r in range(rows)]
    out = decode_kernel.decode_attention(kernel, query, keys, values, 0.125)
    assert out.shape == (rows, kv_heads * group, dim) and out.dtype == dtype
    for r in range(rows):
        grouped = query[r].reshape(1, kv_heads, group, dim).float()
        want = F.scaled_dot_product_attention(grouped, keys[r].float(), values[r].float(), scale=0.125)
        want = want.reshape(kv_heads * group, dim).to(dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
        torch.testing.assert_close(out[r], want, atol=tolerance, rtol=tolerance)
        alone = decode_kernel.decode_attention(
            kernel, query[r : r + 1], keys[r : r + 1], values[r : r + 1], 0.125
        )
        assert torch.equal(alone[0], out[r])  # a row's result does not depend on its neighbours


def test_kernel_refuses_what_it_does_not_handle(kernel: ModuleType) -> None:
    query = torch.randn(1, 4, 16)
    keys, values = [kv(2, 5, 16, 1)], [kv(2, 5, 16, 2)]
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        decode_kernel.decode_attention(kernel, query, [keys[0].bfloat16()], values, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        decode_kernel.decode_attention(kernel, query, [keys[0].half()], [values[0].half()], 1.0)
    with pytest.raises(RuntimeError, match="length"):
        decode_kernel.decode_attention(kernel, query, keys, [kv(2, 6, 16, 3)], 1.0)
    with pytest.raises(RuntimeError, match="one keys"):
        decode_kernel.decode_attention(kernel, query, keys + keys, values, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        decode_kernel.decode_attention(kernel, torch.randn(1, 4, 8), [kv(2, 5, 8, 1)], [kv(2, 5, 8, 2)], 1.0)


def test_batched_steps_with_the_kernel_match_the_single_request_path(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows go to the kernel (one tracking attention too, its mass added up there), a
    prefilling row beside them to sdpa: every row's logits match the same request run alone."""
    model = tiny_llama(31, num_layers=2, hidden=64, heads=4, kv_heads=2)  # head_dim 16, 2 per group
    model.set_attn_implementation("sdpa")
    bf = BatchedForward(model)
    calls: list[int] = []
    real = decode_kernel.decode_attention

    def counted(
        module: ModuleType, query: torch.Tensor, keys: list[torch.Tensor], *rest: object
    ) -> torch.Tensor:
        calls.append(len(keys))
        return real(module, query, keys, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_kernel, "decode_attention", counted)
    histories = [ids(1, 40), ids(2, 7), ids(3, 100), ids(4, 20)]
    prompts = [[5], [6], ids(13, 9), [8]]
    steps = 6
    expected = [
        solo_greedy(model, restored(model, h), p, steps) for h, p in zip(histories, prompts, strict=True)
    ]
    rows = [BatchRow(restored(model, h)) for h in histories[:3]]
    rows.append(BatchRow(restored(model, histories[3]), track_attention=True))
    got = bf.forward([Segment(r, p) for r, p in zip(rows, prompts, strict=True)])
    assert calls == [3, 3]  # rows 0, 1 and 3, once per layer; row 2 prefills
    for step in range(steps):
        for g, (want_tokens, want_logits) in zip(got, expected, strict=True):
            assert g is not None
            torch.testing.assert_close(g, want_logits[step], atol=1e-4, rtol=0)
            assert int(g.argmax()) == want_tokens[step]
        got = bf.forward([Segment(r, [t[step]]) for r, (t, _) in zip(rows, expected, strict=True)])
    assert calls[2:4] == [4, 4]  # then every row decodes through it


@pytest.mark.parametrize("with_kernel", [True, False])
def test_decode_only_steps_match_solo_with_and_without_the_kernel(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, with_kernel: bool
) -> None:
    model = tiny_llama(32, num_layers=2)
    model.set_attn_implementation("sdpa")
    bf = BatchedForward(model)
    calls: list[int] = []
    if with_kernel:
        request.getfixturevalue("kernel")
        real = decode_kernel.decode_attention
        monkeypatch.setattr(decode_kernel, "decode_attention", lambda *a: calls.append(1) or real(*a))
    else:  # still building, or unavailable: sdpa per row
        monkeypatch.setattr(decode_kernel, "loaded", lambda: None)
        monkeypatch.setattr(decode_kernel, "decode_attention", pytest.fail)
    histories = [ids(5, 12), ids(6, 30), ids(7, 1)]
    expected = [solo_greedy(model, restored(model, h), [4], 3) for h in histories]
    rows = [BatchRow(restored(model, h)) for h in histories]
    got = bf.forward([Segment(r, [4]) for r in rows])
    for step in range(3):
        for g, (want_tokens, want_logits) in zip(got, expected, strict=True):
            assert g is not None
            torch.testing.assert_close(g, want_logits[step], atol=1e-4, rtol=0)
            assert int(g.argmax()) == want_tokens[step]
        got = bf.forward([Segment(r, [t[step]]) for r, (t, _) in zip(rows, expected, strict=True)])
    assert len(calls) == (2 * 4 if with_kernel else 0)  # once per layer and step


def test_the_kernel_is_for_fp32_and_bf16_sdpa_on_cpu_with_shapes_it_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[int] = []
    monkeypatch.setattr(decode_kernel, "start", lambda: started.append(1))
    sdpa = tiny_llama(33, num_layers=1)
    sdpa.set_attn_implementation("sdpa")
    assert BatchedForward(sdpa)._native and started == [1]
    eager = BatchedForward(tiny_llama(33, num_layers=1))
    assert not eager._native  # eager attention stays the reference
    assert eager._native_ops and started == [1, 1]  # the Llama step's elementwise operations
    half = BatchedForward(tiny_llama(33, num_layers=1).half(), attention="sdpa")
    assert not half._native and not half._native_ops and started == [1, 1]
    assert BatchedForward(sdpa.to(torch.bfloat16))._native and started == [1, 1, 1]
    narrow = tiny_llama(33, num_layers=1, hidden=32, heads=4)  # head_dim 8: not a multiple of 16
    assert not decode_kernel.fits(narrow.config)
    wide_groups = tiny_llama(33, num_layers=1, hidden=256, heads=16, kv_heads=1)  # 16 per group
    assert not decode_kernel.fits(wide_groups.config)
    assert started == [1, 1, 1]


def test_a_built_kernel_is_loaded_before_the_first_step(kernel: ModuleType) -> None:
    """In a new process (a server's start), with the kernel built before: it is loaded when the
    batched forward is made, so the first request's steps run with it as the later ones do (a
    first step with torch's operators gave KV that differed from the next request's by float
    rounding)."""
    assert decode_kernel.built()
    code = (
        "from kvstrata.engine.batch import BatchedForward, decode_kernel\n"
        "from kvstrata.integrations.transformers.model import tiny_llama\n"
        "model = tiny_llama(33, num_layers=1)\n"
        "model.set_attn_implementation('sdpa')\n"
        "assert decode_kernel.loaded() is None\n"
        "BatchedForward(model)\n"
        "print(decode_kernel.status())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["loaded"]


def test_turning_the_kernel_off_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(decode_kernel.ENV, "0")
    assert decode_kernel._unavailable() == f"turned off ({decode_kernel.ENV}=0)"
    monkeypatch.setenv(decode_kernel.ENV, "1")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert decode_kernel._unavailable() == "no C++ compiler ('no-such-compiler-here' not found)"


def test_the_ninja_wheel_is_found_without_an_activated_venv(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ninja = pytest.importorskip("ninja")  # a dependency of kvstrata
    monkeypatch.setenv("PATH", str(tmp_path))  # neither the venv's bin nor /usr/bin
    assert decode_kernel._ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR


def test_bf16_decode_rows_through_the_kernel_stay_close_to_solo_bf16(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama(34, num_layers=2).to(torch.bfloat16)
    model.set_attn_implementation("sdpa")
    bf = BatchedForward(model)
    calls: list[int] = []
    real = decode_kernel.decode_attention
    monkeypatch.setattr(decode_kernel, "decode_attention", lambda *a: calls.append(1) or real(*a))
    histories = [ids(8, 25), ids(9, 3), ids(10, 60)]
    rows = [BatchRow(restored(model, h)) for h in histories]
    got = bf.forward([Segment(r, [6]) for r in rows])
    assert len(calls) == 2  # one call per layer for the three rows
    for h, g in zip(histories, got, strict=True):
        assert g is not None
        want = solo_forward(model, restored(model, h), [6])
        # bf16 keeps 8 bits of mantissa: packed and single-row matmuls round differently
        torch.testing.assert_close(g, want, atol=0.05, rtol=0.02)


def test_a_lock_left_by_a_killed_build_is_removed_once_no_build_runs(tmp_path: Path) -> None:
    import threading

    directory = tmp_path / decode_kernel.NAME
    directory.mkdir()
    (directory / "lock").touch()  # torch's lock, left by a build that was killed
    entered = threading.Event()

    def other_build() -> None:
        with decode_kernel._builder_lock(directory):
            entered.set()
            decode_kernel._clear_left_lock(directory)

    with decode_kernel._builder_lock(directory):  # a build is running: the other one waits
        thread = threading.Thread(target=other_build)
        thread.start()
        assert not entered.wait(0.3)
        assert (directory / "lock").exists()
    thread.join(10)
    assert entered.is_set() and not (directory / "lock").exists()


def test_clearing_a_left_lock_is_routine_not_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A short CLI command may exit while its background load holds torch's lock: the next one
    clears it without printing to the user's terminal (CLI commands keep stderr clean)."""
    (tmp_path / "lock").touch()
    with caplog.at_level("INFO", logger=decode_kernel.__name__):
        decode_kernel._clear_left_lock(tmp_path)
    assert not (tmp_path / "lock").exists()
    assert [r.levelname for r in caplog.records] == ["INFO"]
