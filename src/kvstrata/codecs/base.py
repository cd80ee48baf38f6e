"""What a codec is: a pure encode/decode pair for one block, and the record it produces.

A block is a tensor of shape ``(2, num_layers, num_kv_heads, num_tokens, head_dim)`` in the
layout's dtype. ``encode`` turns it into an :class:`EncodedBlock` (codec id, a small parameter
record, payload bytes); ``decode`` turns the record back into a tensor of the layout's dtype using
only what the record carries, so decoding never guesses. Codecs do no I/O and hold no state
besides their frozen configuration.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from kvstrata.layout import KVLayout
from kvstrata.transfer import has_host_array, host_array


class CodecId(enum.IntEnum):
    """Stable numeric ids; they are written into every block record, never renumber them."""

    IDENTITY = 0
    LOSSLESS = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4
    KIVI4 = 5
    KIVI2 = 6
    DELTA = 7
    SPARSE = 8
    NAIVE_INT4 = 9
    INT8S = 10
    KVMIX = 11


@dataclass(frozen=True, slots=True)
class EncodedBlock:
    """A block in encoded form, as every tier below L1 keeps it."""

    codec: CodecId
    params: bytes
    payload: bytes | memoryview
    """The encoded bytes; a memoryview where a tier or codec hands out its memory without a copy
    (the identity codec over a tensor it was given, a verified file read)."""
    num_tokens: int

    @property
    def nbytes(self) -> int:
        return len(self.params) + len(self.payload)


@dataclass(frozen=True, slots=True)
class BlockContext:
    """Where a block sits in its sequence; position-aware codecs (KIVI sinks) read it."""

    start_pos: int = 0


# A module-level default, so that ``encode(kv)`` signatures share one immutable instance.
DEFAULT_CONTEXT = BlockContext()


@runtime_checkable
class Codec(Protocol):
    codec_id: ClassVar[CodecId]
    name: ClassVar[str]
    lossless: ClassVar[bool]
    loss_rank: ClassVar[int]
    """How much the codec loses: 0 exact, higher is lossier (fp16/bf16 1, int8 2, KIVI 4-bit 3,
    kvmix 4, KIVI 2-bit 5, sparse and naive int4 6). A session attends only to stored blocks no lossier than
    its class allows (``CodecLadder.max_loss_rank``); a block is never re-encoded to a codec of a
    lower or equal rank."""

    def encode(self, kv: torch.Tensor, ctx: BlockContext = ...) -> EncodedBlock: ...

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor: ...


def tensor_bytes(kv: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (any dtype, bfloat16 included), in C order."""
    flat = kv.detach().to("cpu").contiguous().view(torch.uint8)
    return flat.numpy().tobytes()


def tensor_buffer(kv: torch.Tensor) -> memoryview:
    """The bytes of a tensor without a copy when it is already a contiguous CPU tensor (the
    buffer then shares its memory: the tensor must not change while the buffer is in use).

    That case takes no torch operator: each one lets go of the GIL, and on a thread appending
    blocks while the store's writer runs, getting it back took up to the interpreter's switch
    interval (5 ms) each time: this line was 0.26 ms a block of a 512-block checkpoint."""
    if has_host_array(kv) and kv.is_contiguous():
        return memoryview(host_array(kv)).cast("B")
    flat = kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def tensor_from_bytes(
    payload: bytes | bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A fresh, writable tensor holding ``payload`` reinterpreted as ``dtype`` with ``shape``."""
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
