"""bf16 linear layers on the CPU with their weights packed once for oneDNN.

On the CPU a bf16 ``nn.Linear`` already runs on oneDNN, but ``F.linear`` re-lays the weight out
into oneDNN's blocked format on every call. Decoding a small model is mostly those calls with a
few rows each (one per sequence of the batch), so the relayout is a large part of a step: packing
every weight once (``mkldnn._reorder_linear_weight``) and calling the packed kernel
(``mkldnn._linear_pointwise``) gives the same results bit for bit and made SmolLM2's bf16 decode
step about 1.5x faster on this project's machine (``kvstrata bench batching``; vLLM's CPU backend
packs its weights the same way). The model keeps its weights; the packed copies live beside them,
so the model's memory for linear weights doubles. For inference only: a weight changed after
packing is not seen.

fp32 linear layers: torch's own kernel (MKL's sgemm) is fast for one row (a single session's
decode step) but slow for a few rows. On an AMD EPYC VM (2026-11-30) 2, 3, 6, 7, 10 and 11 rows
cost more than 4, 8 and 12 (all of SmolLM2's linear layers of a step 62 ms for 3 rows against 48 ms
for 4); on an Intel Xeon VM with AVX-512 (2026-12-03, loaded) 4 to 16 rows cost about twice 1 to
3 rows (51 ms for 4 rows against 27 ms for 3), where oneDNN with its weights packed once took 34 ms
for 4 rows and 39 ms for 8 against MKL's 77 ms (a decode step of 8 sessions 1.2-1.3x more tokens/s
end to end). So :func:`pad_fp32_linears` gives each fp32 linear a oneDNN-packed copy of its
weight and sends 2 to 63 rows to it. One row and prefill chunks (64 rows and more) go where they
run faster on this CPU, measured once per weight shape when the model is prepared
(:func:`measure_routes`): on the Intel VM MKL was fast for one row; on an AMD EPYC VM (Zen 5,
2026-12-05) MKL took 2.3x the packed kernel's time for one row and 2.1-2.6x for 64 and 256 rows
(all of SmolLM2's linear shapes, alternated, one thread), the slow paths MKL is known to take on
AMD CPUs, where vLLM's CPU backend runs every linear on oneDNN. Where oneDNN is not available
it pads 2 or 3 rows past a multiple of 4 with zero rows up to that multiple instead and drops the
extra output rows. Either way each row's result is computed
from that row alone (float rounding may differ between the kernels).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
import types
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_PACKED = "_kvstrata_packed_weight"


def bf16_packing_available() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: torch.nn.Module) -> int:
    """Pack every bf16 ``nn.Linear`` on the CPU of ``model`` (idempotent); how many were packed
    now. Nothing happens where oneDNN has no bf16 support."""
    if not bf16_packing_available():
        return 0
    packed = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if (
                type(module) is not torch.nn.Linear
                or hasattr(module, _PACKED)
                or weight is None
                or weight.dtype != torch.bfloat16
                or weight.device.type != "cpu"
            ):
                continue
            setattr(module, _PACKED, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
            module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
            packed += 1
    return packed


def packed_for_rows(module: torch.nn.Module, rows: int) -> torch.Tensor | None:
    """The packed weight ``module``'s forward runs ``rows`` rows through with :func:`packed_linear`:
    a bf16 one (:func:`pack_linears`) always, an fp32 one (:func:`pad_fp32_linears`) where its
    routes send that many rows; None where another kernel runs them."""
    packed = getattr(module, _PACKED, None)
    if packed is not None:
        return packed
    packed = getattr(module, _PACKED_FP32, None)
    if packed is None or rows < 1:
        return None
    if 2 <= rows < _PAD_BELOW:
        return packed
    routes: Routes = getattr(module, _PADDED)
    return packed if (routes.chunks if rows >= _PAD_BELOW else routes.one_row) else None


def is_packed(module: torch.nn.Module) -> bool:
    """Whether :func:`pack_linears` or :func:`pad_fp32_linears` changed ``module``."""
    return hasattr(module, _PACKED) or hasattr(module, _PADDED)


def unpack(module: torch.nn.Module) -> None:
    """Undo :func:`pack_linears` / :func:`pad_fp32_linears` on one module: its packed copy is
    dropped and it runs ``F.linear`` on its weight again."""
    for name in (_PACKED, _PACKED_FP32, _PADDED):
        if hasattr(module, name):
            delattr(module, name)
    module.__dict__.pop("forward", None)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, getattr(self, _PACKED), self.bias)


def rows_bucket(rows: int) -> int:
    """The row count the packed kernel is called with for ``rows`` rows: one row as it is, up to
    64 a multiple of 8, past that a multiple of a quarter to an eighth of the power of two below
    (at most a quarter more rows). oneDNN and torch's ideep layer each keep the kernel they built
    for every input shape (up to 1,024 each, about 0.3 MB apiece, and about 7 ms to build one):
    called with every row count a server meets, their caches grew by hundreds of megabytes over
    hours and each new count paid a build (issue 32's soak); the buckets bound the shapes to a
    few dozen per weight, built within the first minutes."""
    if rows <= 1:
        return rows
    if rows <= 64:
        return -(-rows // 8) * 8
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` through the packed weight, its rows padded with zeros up to :func:`rows_bucket` (each
    row's result is its own: the padding rows are dropped). The native decode step
    (``engine/batch/decode_step.cpp``) does the same in C++: change both together."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    bucket = rows_bucket(rows)
    if bucket == rows:
        return _LINEAR(x, packed, bias, "none", [], "")
    flat = x.reshape(rows, features)
    padded = torch.cat([flat, flat.new_zeros(bucket - rows, features)])
    out = _LINEAR(padded, packed, bias, "none", [], "")[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


_LINEAR = torch.ops.mkldnn._linear_pointwise
"""oneDNN's kernel on a packed weight (a name of this module's: tests count its shapes)."""


_PADDED = "_kvstrata_padded"
_PACKED_FP32 = "_kvstrata_packed_fp32_weight"
_PAD_BELOW = 64
"""Row counts from here on are left alone: the slow kernels are MKL's small-matrix ones."""
_PACK_ROWS = 8
"""The row count oneDNN lays the packed fp32 weights out for (a batch of decode steps)."""


@dataclass(frozen=True)
class Routes:
    """Which fp32 row counts besides 2 to 63 run on the packed weights."""

    one_row: bool = False
    """A lone decode step."""
    chunks: bool = False
    """Prefill chunks (``_PAD_BELOW`` rows and more)."""


_MEASURE_ROWS = {"one_row": 1, "chunks": _PAD_BELOW}
_MEASURE_REPEATS = 7
_FASTER = 0.9
"""The packed kernel takes a row count over when it needs at most this share of MKL's time."""
_COLD_BYTES = 48 << 20
"""The measurement cycles through copies of the weight at least this large in all, more than
the CPU's caches hold: a decode step reads every layer's weight from memory (its model is larger
than the caches), and a kernel timed on one weight kept in the cache misses that. On an AMD EPYC VM
(2026-12-05), one row through SmolLM2's 576x576 layer: MKL 0.039 ms and packed oneDNN 0.034 ms
with the weight in the cache, 0.081 and 0.054 ms from memory (1536x576: 0.059 and 0.054 in the
cache, 0.217 and 0.122 from memory), so timed in the cache one row stayed on MKL."""

_MAX_COPIES = 128
"""At most this many copies: a small weight would need thousands to fill :data:`_COLD_BYTES`
(3,072 of a test model's 64x64 layer), while a model of such layers sits in the caches anyway.
Uncapped, the measurement of the tiny test model's shapes took 116-273 s of a process's start
beside other work (a ``kvstrata serve`` silent for minutes); SmolLM2's shapes need 1 to 114."""


@functools.lru_cache(maxsize=32)
def measure_routes(out_features: int, in_features: int) -> Routes:
    """Time MKL (``F.linear``) against the packed oneDNN kernel on random fp32 weights of this
    shape, read from memory as in a decode step (:data:`_COLD_BYTES`), alternated, for one row and
    for a prefill chunk: the medians decide (once per shape and process; about 0.3 s for each of
    SmolLM2's shapes)."""
    gen = torch.Generator().manual_seed(0)
    copies = min(_MAX_COPIES, max(1, -(-_COLD_BYTES // (out_features * in_features * 4))))
    weights = list(torch.randn(copies, out_features, in_features, generator=gen).unbind())
    with torch.no_grad():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS) for w in weights]
        chosen = {}
        for name, rows in _MEASURE_ROWS.items():
            x = torch.randn(rows, in_features, generator=gen)
            times: dict[str, list[float]] = {"mkl": [], "packed": []}
            for _ in range(_MEASURE_REPEATS):
                for kernel in times:
                    started = time.perf_counter()
                    if kernel == "mkl":
                        for weight in weights:
                            torch.nn.functional.linear(x, weight)
                    else:
                        for weight in packed:
                            torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
                    times[kernel].append((time.perf_counter() - started) / copies)
            mkl, onednn = statistics.median(times["mkl"]), statistics.median(times["packed"])
            chosen[name] = onednn <= _FASTER * mkl
            log.info(
                "fp32 linear %dx%d, %d rows, from memory: MKL %.3f ms, packed oneDNN %.3f ms",
                out_features,
                in_features,
                rows,
                mkl * 1e3,
                onednn * 1e3,
            )
    return Routes(**chosen)


def pad_fp32_linears(model: torch.nn.Module, routes: Routes | None = None) -> int:
    """Make every fp32 ``nn.Linear`` on the CPU of ``model`` run 2 to 63 rows on a oneDNN-packed
    copy of its weight, one row and prefill chunks where ``routes`` sends them (None: measured on
    this CPU, :func:`measure_routes`), or where oneDNN is missing pad 2 or 3 rows past a multiple of
    4 to that multiple (idempotent); how many were changed now."""
    pack = torch.backends.mkldnn.is_available()
    changed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) is not torch.nn.Linear
            or hasattr(module, _PADDED)
            or hasattr(module, _PACKED)
            or weight is None
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
        ):
            continue
        setattr(module, _PADDED, Routes())
        if pack:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)
            setattr(module, _PACKED_FP32, packed)
            setattr(module, _PADDED, routes if routes is not None else measure_routes(*weight.shape))
        module.forward = types.MethodType(_padded_forward, module)  # type: ignore[method-assign]
        changed += 1
    return changed


def _padded_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    packed = packed_for_rows(self, rows)
    if packed is not None:
        return packed_linear(x, packed, self.bias)
    if rows >= _PAD_BELOW or rows % 4 < 2:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, features)
    padded = torch.cat([flat, flat.new_zeros(4 - rows % 4, features)])
    out = torch.nn.functional.linear(padded, self.weight, self.bias)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])
