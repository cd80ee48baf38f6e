"""The native dequantization of resident pages (``pages_dequant.c``), one layer at a time.

Why: a prefill that continues a session whose blocks are held encoded attends with torch's sdpa,
which needs the layer's keys and values as tensors; dequantizing them with torch takes several
operations per block (and one Python call each), this takes one call per layer. Built on first
use (:mod:`kvstrata.native`); until then, and where it cannot be, :mod:`kvstrata.codecs.arena`
dequantizes with torch, to the same bits.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from kvstrata.native import NativeLibrary

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
MAX_HEAD_DIM = 256
"""The widest head the library dequantizes (its key tile's TILE_DIM)."""


def _setup(lib: ctypes.CDLL) -> str | None:
    lib.kvs_pages_supported.restype = ctypes.c_int
    lib.kvs_pages_supported.argtypes = []
    if not lib.kvs_pages_supported():
        return "this CPU has no AVX-512"
    lib.kvs_pages_dequant.restype = None
    lib.kvs_pages_dequant.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64]
    lib.kvs_pages_dequant_layers.restype = None
    lib.kvs_pages_dequant_layers.argtypes = [_PTR, _PTR, *[_I64] * 4, _PTR, _PTR, *[_I64] * 4]
    return None


LIBRARY = NativeLibrary(
    "pages_dequant",
    Path(__file__).with_name("pages_dequant.c"),
    ["-O3", "-ffp-contract=off", "-fno-math-errno"],
    _setup,
)


def dequantize_layer(
    arena: torch.Tensor, table: torch.Tensor, layer: int, heads: int, out_k: torch.Tensor, out_v: torch.Tensor
) -> bool:
    """Dequantize every page of ``table`` (checked against ``arena`` by the caller) at ``layer``
    into ``out_k`` / ``out_v`` (float32 or bfloat16 CPU ``(heads, >= tokens, head_dim)``, head_dim
    contiguous and at most 256, the same dtype and strides; bfloat16 rounded as ``.to()``
    rounds); False when the library is not loaded (yet) or the tensors do not fit it: the caller
    dequantizes with torch. Starts the library's build on first use."""
    lib = LIBRARY.ready()
    if lib is None:
        return False
    if not _takes(out_k, out_v) or arena.device.type != "cpu" or not table.is_contiguous():
        return False
    if not arena.is_contiguous():
        return False
    lib.kvs_pages_dequant(
        arena.data_ptr(), table.data_ptr(), table.shape[0], layer, heads, out_k.shape[-1],
        out_k.data_ptr(), out_v.data_ptr(), out_k.stride(0), out_k.stride(1),
        int(out_k.dtype is torch.bfloat16),
    )  # fmt: skip
    return True


def dequantize_block(payload: bytes | memoryview, row: list[int], out: torch.Tensor) -> bool:
    """One block's pages (``payload``: a record that is its pages, read where it lies; ``row``: its
    page table row, both checked by the caller) into ``out`` ``(2, layers, heads, tokens,
    head_dim)``, every layer in one call; False where :func:`dequantize_layer` would be."""
    lib = LIBRARY.ready()
    if lib is None or out.dim() != 5 or out.shape[3] != row[2]:
        return False
    keys, values = out[0], out[1]
    if not _takes(keys, values):
        return False
    pages = np.frombuffer(payload, dtype=np.uint8)
    table = (_I64 * len(row))(*row)
    lib.kvs_pages_dequant_layers(
        pages.ctypes.data, ctypes.addressof(table), 1, out.shape[1], out.shape[2], out.shape[4],
        keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
        int(out.dtype is torch.bfloat16),
    )  # fmt: skip
    return True


def _takes(out_k: torch.Tensor, out_v: torch.Tensor) -> bool:
    """Whether the library writes into ``out_k`` / ``out_v``: float32 or bfloat16 CPU tensors of
    one dtype and one stride, head_dim contiguous and at most ``MAX_HEAD_DIM``."""
    return (
        out_k.device.type == "cpu"
        and out_k.dtype in (torch.float32, torch.bfloat16)
        and out_v.dtype is out_k.dtype
        and out_k.shape[-1] <= MAX_HEAD_DIM
        and out_k.stride() == out_v.stride()
        and out_k.stride(-1) == 1
    )
