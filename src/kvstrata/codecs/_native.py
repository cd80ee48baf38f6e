"""The int8 codec's native decode (``int8_dequant.c``): codes scaled and shifted straight into
the destination in one pass, the same bits as the torch path.

Why: torch decodes int8 in two passes over the float32 destination (``torch.mul`` of the codes
by their scales into it, then ``add_`` of the zero points), memory-bound: 0.40-0.44 ms a
SmolLM2 block (64 tokens) on this machine against 0.18-0.23 ms in one pass (alternated in one
process, medians of 40). It is built on first use (:mod:`kvstrata.native`); until then, and
where it cannot be, the torch path decodes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from kvstrata.native import NativeLibrary

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _setup(lib: ctypes.CDLL) -> str | None:
    lib.kvs_int8_supported.restype = ctypes.c_int
    lib.kvs_int8_supported.argtypes = []
    if not lib.kvs_int8_supported():
        return "this CPU has no AVX-512"
    lib.kvs_int8_dequant.restype = None
    lib.kvs_int8_dequant.argtypes = [_PTR, _PTR, _PTR, _PTR, *[_I64] * 10]
    return None


LIBRARY = NativeLibrary(
    "int8_dequant",
    Path(__file__).with_name("int8_dequant.c"),
    ["-O3", "-ffp-contract=off", "-fno-math-errno"],
    _setup,
)


def dequantize_payload_into(payload: memoryview, groups: int, group: int, dest: torch.Tensor) -> bool:
    """Decode an int8 record's ``payload`` as it lies (``groups * group`` uint8 codes, then
    ``groups`` float16 scales, then as many zero points: the caller has checked its length) into
    ``dest`` (float32 CPU ``(2, L, H, T, D)``, ``D`` contiguous, ``groups * group`` values), with
    no copy and no tensor made of it; False when the native library is not loaded (yet) or the
    shapes do not fit it: the caller decodes with torch. A tensor of the payload cost more than
    the decode: it copies the codes to be writable (0.17 ms a SmolLM2 block, warm), and a fresh
    buffer for them faults page by page on this VM."""
    lib = LIBRARY.ready()
    if lib is None:
        return False
    count = groups * group
    if (
        dest.dim() != 5
        or dest.dtype is not torch.float32
        or dest.device.type != "cpu"
        or dest.stride(-1) != 1
        or dest.shape[-1] % group
        or dest.numel() != count
        or payload.nbytes != count + 4 * groups
    ):
        return False
    codes = np.frombuffer(payload, dtype=np.uint8).ctypes.data  # read-only is fine: only read
    n0, n1, n2, n3, row = dest.shape
    s0, s1, s2, s3, _ = dest.stride()
    lib.kvs_int8_dequant(
        codes, codes + count, codes + count + 2 * groups, dest.data_ptr(),
        n0, n1, n2, n3, s0, s1, s2, s3, row, group,
    )  # fmt: skip
    return True


def dequantize_into(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dest: torch.Tensor) -> bool:
    """Decode ``codes`` (``(groups, group)`` uint8, contiguous) with ``scale`` and ``zero``
    (float16, one per group) into ``dest`` (float32 CPU ``(2, L, H, T, D)``, ``D`` contiguous);
    False when the native library is not loaded (yet) or the shapes do not fit it: the caller
    decodes with torch. Starts the library's build on first use."""
    lib = LIBRARY.ready()
    if lib is None:
        return False
    group = codes.shape[-1]
    if (
        dest.dim() != 5
        or codes.dtype is not torch.uint8
        or scale.dtype is not torch.float16
        or zero.dtype is not torch.float16
        or dest.dtype is not torch.float32
        or dest.device.type != "cpu"
        or dest.stride(-1) != 1
        or dest.shape[-1] % group
        or not (codes.is_contiguous() and scale.is_contiguous() and zero.is_contiguous())
        or codes.numel() != dest.numel()
        or scale.numel() * group != codes.numel()
        or zero.numel() != scale.numel()
    ):
        return False
    n0, n1, n2, n3, row = dest.shape
    s0, s1, s2, s3, _ = dest.stride()
    lib.kvs_int8_dequant(
        codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), dest.data_ptr(),
        n0, n1, n2, n3, s0, s1, s2, s3, row, group,
    )  # fmt: skip
    return True
