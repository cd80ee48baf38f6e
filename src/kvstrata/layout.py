"""Model KV geometry: how many bytes a block of tokens takes, and the layout fingerprint.

Every persisted object carries the layout fingerprint so that data written for one geometry,
dtype or block size is never read back into another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from kvstrata.errors import ConfigError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    # vLLM's fp8 KV caches (``--kv-cache-dtype fp8``): stored byte for byte, never re-encoded
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
"""Layout dtypes that only the byte-exact codecs store (``CodecLadder.for_layout``)."""
FP8_TORCH_DTYPES = frozenset(_DTYPES[name] for name in FP8_DTYPES)

LAYOUT_FINGERPRINT_BYTES = 16


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"unsupported KV dtype {dtype}; supported: {', '.join(_DTYPES)}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of one model's KV cache, and of the blocks kvstrata stores for it.

    A block tensor has shape ``(2, num_layers, num_kv_heads, num_tokens, head_dim)``: keys first,
    then values, so the raw bytes are "K then V" as the on-disk format promises.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    block_tokens: int = 64
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"KVLayout.dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        canonical = json.dumps(self.describe(), sort_keys=True).encode()
        digest = hashlib.blake2b(canonical, digest_size=LAYOUT_FINGERPRINT_BYTES, person=b"kvstrata-layout")
        object.__setattr__(self, "fingerprint", digest.digest())

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def fp8(self) -> bool:
        """Whether blocks are 8-bit floats (vLLM's fp8 caches): kept as they are, never re-quantized."""
        return self.dtype in FP8_DTYPES

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_tokens

    def block_shape(self, num_tokens: int | None = None) -> tuple[int, int, int, int, int]:
        tokens = self.block_tokens if num_tokens is None else num_tokens
        return (2, self.num_layers, self.num_kv_heads, tokens, self.head_dim)

    def block_nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens

    def describe(self) -> dict[str, int | str]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
        }

    def to_json(self) -> str:
        return json.dumps(self.describe(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVLayout:
        try:
            data = json.loads(text)
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid layout description {text!r}: {exc}") from exc

    def check_block(self, kv: torch.Tensor, num_tokens: int | None = None) -> None:
        """Raise ``ConfigError`` unless ``kv`` is a block tensor of this layout."""
        if kv.dtype != self.torch_dtype:
            raise ConfigError(f"block dtype {kv.dtype} does not match layout dtype {self.dtype}")
        if kv.dim() != 5 or tuple(kv.shape[:3]) != self.block_shape(1)[:3] or kv.shape[4] != self.head_dim:
            raise ConfigError(f"block shape {tuple(kv.shape)} does not match layout {self.block_shape()}")
        if num_tokens is not None and kv.shape[3] != num_tokens:
            raise ConfigError(f"block holds {kv.shape[3]} tokens, expected {num_tokens}")
        if not 0 < kv.shape[3] <= self.block_tokens:
            raise ConfigError(f"a block holds 1..{self.block_tokens} tokens, got {kv.shape[3]}")
