"""``KVBlock``: one block of KV cache as it travels between tiers.

A block is either decoded (a tensor, as L1 keeps it) or encoded (an :class:`EncodedBlock`, as
L2, L3 and remote tiers keep it), or both; conversion happens lazily and only once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata import codecs
from kvstrata.codecs.base import BlockContext, Codec, EncodedBlock
from kvstrata.codecs.identity import IdentityCodec
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.transfer import DeviceCopier, copy_tensor

_IDENTITY = IdentityCodec()


@dataclass(slots=True)
class KVBlock:
    key: BlockKey
    num_tokens: int
    start_pos: int = 0
    tensor: torch.Tensor | None = None
    encoded: EncodedBlock | None = None
    namespace: str | None = None
    """The namespace (tenant) the block belongs to; its key seals the block at rest."""

    def __post_init__(self) -> None:
        assert self.tensor is not None or self.encoded is not None, "a block needs data"

    def decoded(self, layout: KVLayout) -> torch.Tensor:
        if self.tensor is None:
            assert self.encoded is not None
            self.tensor = codecs.decode(self.encoded, layout)
        return self.tensor

    def encode(self, codec: Codec = _IDENTITY) -> EncodedBlock:
        """The encoded form; an existing encoding is kept (re-encoding is the store's decision)."""
        if self.encoded is None:
            assert self.tensor is not None
            self.encoded = codec.encode(self.tensor, BlockContext(self.start_pos))
        return self.encoded

    def reencoded(self, codec: Codec, layout: KVLayout) -> KVBlock:
        """A copy encoded with ``codec`` (decoding first if it is held in another codec)."""
        if self.encoded is not None and self.encoded.codec == codec.codec_id:
            return KVBlock(
                self.key, self.num_tokens, self.start_pos, self.tensor, self.encoded, self.namespace
            )
        tensor = self.decoded(layout)
        encoded = codec.encode(tensor, BlockContext(self.start_pos))
        return KVBlock(self.key, self.num_tokens, self.start_pos, None, encoded, self.namespace)


def decode_into_room(block: KVBlock, room: torch.Tensor, copier: DeviceCopier, layout: KVLayout) -> None:
    """Decode ``block`` into the first tokens of ``room`` (its slice of a restore's buffer): a
    decoded block is copied, an encoded one decoded in place (through ``copier``'s staging
    buffers when it stages, for a device destination)."""
    dest = room[:, :, :, : block.num_tokens]
    if block.tensor is not None:
        copy_tensor(dest, block.tensor)
        return
    assert block.encoded is not None
    if not copier.staged:
        codecs.decode_into(block.encoded, layout, dest)
    else:
        staged = copier.stage(tuple(dest.shape), dest.dtype)
        codecs.decode_into(block.encoded, layout, staged)
        copier.commit(dest, staged)
