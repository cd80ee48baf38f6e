"""The int8 and int8s codecs' native encode (``int8_quant.c``): a block's codes and scales in one
pass per group, the same bits as the torch path.

Why: every block an interactive agent commits is encoded twice off the request path (int8s for
device memory, int8 for L2 and L3), and with torch each encode is about ten passes over the
block (the finite check, min, max, the fp16 rounding, subtract, divide, round, clamp, cast, the
page layout's transposes): 0.8-0.9 ms a SmolLM2 block of 16 tokens on this machine. On two cores
that work competes with the next request's prefill: replaying the synthetic trace, most requests
compute their whole prompt and their TTFT was 4-5 ms (7%) above plain LRU's, whose exact blocks
need no encoding. Built on first use (:mod:`kvstrata.native`); until then, and where it cannot
be, torch encodes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvstrata.codecs._quant import SCALE_BYTES
from kvstrata.errors import CodecError
from kvstrata.native import NativeLibrary

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _setup(lib: ctypes.CDLL) -> str | None:
    lib.kvs_quant_supported.restype = ctypes.c_int
    lib.kvs_quant_supported.argtypes = []
    if not lib.kvs_quant_supported():
        return "this CPU has no AVX-512 or F16C"
    lib.kvs_int8_quant.restype = ctypes.c_int
    lib.kvs_int8_quant.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR]
    lib.kvs_int8s_quant.restype = ctypes.c_int
    lib.kvs_int8s_quant.argtypes = [_PTR, *[_I64] * 5, _PTR]
    return None


LIBRARY = NativeLibrary(
    "int8_quant",
    Path(__file__).with_name("int8_quant.c"),
    ["-O3", "-ffp-contract=off", "-fno-math-errno"],
    _setup,
)


def _fits(x: torch.Tensor) -> bool:
    return x.dtype is torch.float32 and x.device.type == "cpu" and x.is_contiguous()


def _check(status: int, codec_name: str, what: str) -> None:
    if status == 1:
        raise CodecError(f"{codec_name} cannot encode a block holding NaN or inf")
    if status:
        raise CodecError(f"{codec_name}: block values exceed the fp16 range of {what}")


def int8_payload(x: torch.Tensor, group: int) -> bytes | None:
    """The int8 record's payload of float32 ``x`` (codes, then fp16 scales, then fp16 zero points,
    one per ``group`` values), or None when the library is not loaded (yet) or ``x`` does not fit
    it (the caller encodes with torch). Raises :class:`CodecError` as the torch path does."""
    lib = LIBRARY.ready()
    if lib is None or not _fits(x) or x.numel() % group:
        return None
    count = x.numel()
    groups = count // group
    out = bytearray(count + 2 * groups * SCALE_BYTES)
    base = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
    status = lib.kvs_int8_quant(x.data_ptr(), groups, group, base, base + count, base + count + 2 * groups)
    _check(status, "int8", "scales and zero points")
    return bytes(out)


def int8s_pages(x: torch.Tensor, group: int, padded: int, page_nbytes: int) -> bytes | None:
    """The int8s record's pages of float32 ``x`` ``(2, L, H, T, D)`` (``padded`` the tokens
    rounded up as the page layout pads keys; ``page_nbytes`` one page's bytes), or None when the
    library is not loaded (yet) or ``x`` does not fit it. Raises :class:`CodecError` as the torch
    path does."""
    lib = LIBRARY.ready()
    if lib is None or not _fits(x) or x.dim() != 5:
        return None
    _, layers, heads, tokens, dim = x.shape
    runs = layers * heads
    out = bytearray(runs * page_nbytes)
    base = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
    status = lib.kvs_int8s_quant(x.data_ptr(), runs, tokens, padded, dim, group, base)
    _check(status, "int8s", "scales")
    return bytes(out)
