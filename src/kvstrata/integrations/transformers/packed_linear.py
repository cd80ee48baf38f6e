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

fp32 linear layers keep torch's own kernel (MKL's sgemm), which is slow for some small row counts
on this machine: 2, 3, 6, 7, 10 and 11 rows cost more than 4, 8 and 12 (SmolLM2's layers, 2
cores, 2026-11-30: all linear layers of a step 62 ms for 3 rows against 48 ms for 4; its 49,152-row
output layer 34.5 against 17.7 ms), so a batched step of 3 rows took 125 ms against 103 ms for 4.
:func:`pad_fp32_linears` pads such inputs with zero rows up to the next multiple of 4 and drops
the extra output rows (each row's result is computed from that row alone).
"""

from __future__ import annotations

import types

import torch

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


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, getattr(self, _PACKED), self.bias, "none", [], "")


_PADDED = "_kvstrata_padded"
_PAD_BELOW = 64
"""Row counts from here on are left alone: the slow kernels are MKL's small-matrix ones."""


def pad_fp32_linears(model: torch.nn.Module) -> int:
    """Make every fp32 ``nn.Linear`` on the CPU of ``model`` pad 2 or 3 rows past a multiple of 4
    (under 64 rows) to that multiple (idempotent); how many were changed now."""
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
        setattr(module, _PADDED, True)
        module.forward = types.MethodType(_padded_forward, module)  # type: ignore[method-assign]
        changed += 1
    return changed


def _padded_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if rows >= _PAD_BELOW or rows % 4 < 2:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, features)
    padded = torch.cat([flat, flat.new_zeros(4 - rows % 4, features)])
    out = torch.nn.functional.linear(padded, self.weight, self.bias)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])
