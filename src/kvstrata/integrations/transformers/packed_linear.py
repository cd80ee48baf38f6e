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
