"""Block codecs: pure functions that encode a KV block to bytes and back.

``get_codec(name)`` builds a codec with default settings; ``decode(block, layout)`` decodes any
record by the codec id it carries. The registry below is the one place names map to classes.
"""

from __future__ import annotations

import torch

from kvstrata.codecs.base import BlockContext, Codec, CodecId, EncodedBlock
from kvstrata.codecs.delta import DeltaCodec
from kvstrata.codecs.downcast import Bf16Codec, Fp16Codec
from kvstrata.codecs.identity import IdentityCodec
from kvstrata.codecs.int8 import Int8Codec
from kvstrata.codecs.int8s import Int8SymCodec
from kvstrata.codecs.kivi import Kivi2Codec, Kivi4Codec
from kvstrata.codecs.kvmix import KvmixCodec
from kvstrata.codecs.lossless import LosslessCodec
from kvstrata.codecs.naive_int4 import NaiveInt4Codec
from kvstrata.codecs.sparse import SparseCodec
from kvstrata.errors import ConfigError, CorruptBlockError
from kvstrata.layout import KVLayout
from kvstrata.transfer import copy_tensor

_REGISTRY: dict[CodecId, type] = {
    CodecId.IDENTITY: IdentityCodec,
    CodecId.LOSSLESS: LosslessCodec,
    CodecId.FP16: Fp16Codec,
    CodecId.BF16: Bf16Codec,
    CodecId.INT8: Int8Codec,
    CodecId.KIVI4: Kivi4Codec,
    CodecId.KIVI2: Kivi2Codec,
    CodecId.DELTA: DeltaCodec,
    CodecId.SPARSE: SparseCodec,
    CodecId.NAIVE_INT4: NaiveInt4Codec,
    CodecId.INT8S: Int8SymCodec,
    CodecId.KVMIX: KvmixCodec,
}


def register(codec_cls: type) -> type:
    _REGISTRY[codec_cls.codec_id] = codec_cls
    return codec_cls


def codec_names() -> list[str]:
    return [cls.name for cls in _REGISTRY.values()]


def get_codec(name: str | CodecId, **options: object) -> Codec:
    """A codec instance by name (``"int8"``) or id, with ``options`` passed to its config."""
    for codec_id, cls in _REGISTRY.items():
        if name == cls.name or name == codec_id:
            try:
                return cls(**options)
            except TypeError as exc:
                raise ConfigError(f"invalid options for codec {cls.name}: {exc}") from exc
    raise ConfigError(f"unknown codec {name!r}; known: {', '.join(codec_names())}")


def loss_rank(codec: str | CodecId | int) -> int:
    """The ``loss_rank`` of a codec given by name (``"int8"``) or id (as a record carries it)."""
    if isinstance(codec, str):
        return get_codec(codec).loss_rank
    try:
        cls = _REGISTRY[CodecId(codec)]
    except (ValueError, KeyError):
        raise CorruptBlockError(f"block record names unknown codec id {int(codec)}") from None
    return int(cls.loss_rank)


def decode_into(block: EncodedBlock, layout: KVLayout, dest: torch.Tensor) -> None:
    """Decode ``block`` into ``dest`` (a view shaped like the block, on any device): codecs that
    can write there directly do (identity: one copy); the others decode, then copy."""
    cls = _REGISTRY.get(block.codec)
    if cls is None:
        raise CorruptBlockError(f"block record names unknown codec id {int(block.codec)}")
    codec = cls()
    into = getattr(codec, "decode_into", None)
    if into is not None and dest.device.type == "cpu":
        into(block, layout, dest)
    else:
        copy_tensor(dest, codec.decode(block, layout))


def decode(block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
    """Decode a record with the codec its id names; an unknown id is corruption, never a guess."""
    cls = _REGISTRY.get(block.codec)
    if cls is None:
        raise CorruptBlockError(f"block record names unknown codec id {int(block.codec)}")
    return cls().decode(block, layout)


__all__ = [
    "Bf16Codec",
    "BlockContext",
    "Codec",
    "CodecId",
    "DeltaCodec",
    "EncodedBlock",
    "Fp16Codec",
    "IdentityCodec",
    "Int8Codec",
    "Int8SymCodec",
    "Kivi2Codec",
    "Kivi4Codec",
    "KvmixCodec",
    "LosslessCodec",
    "NaiveInt4Codec",
    "SparseCodec",
    "codec_names",
    "decode",
    "decode_into",
    "get_codec",
    "loss_rank",
    "register",
]
