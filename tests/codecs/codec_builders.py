"""Block builders for the codec tests: a small layout and seeded random blocks.

A plain module, not a conftest: ``tests/conftest.py`` is imported as ``conftest`` by other test
modules, and a second conftest here would shadow it.
"""

from __future__ import annotations

import torch

from kvstrata.layout import KVLayout


def make_layout(dtype: str = "float32", head_dim: int = 64) -> KVLayout:
    """2 layers, 2 KV heads, 16-token blocks."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype=dtype, block_tokens=16)


def make_block(
    layout: KVLayout, tokens: int | None = None, seed: int = 0, outlier_keys: bool = False
) -> torch.Tensor:
    """A seeded random normal block in the layout dtype.

    With ``outlier_keys`` four head_dim channels of K get a large offset and spread, the shape real
    (post-RoPE) keys have and per-token quantization handles badly.
    """
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(layout.block_shape(tokens), generator=gen)
    if outlier_keys:
        channels = torch.tensor([3, 17, 40, 41]) % layout.head_dim
        kv[0, :, :, :, channels] = kv[0, :, :, :, channels] * 8.0 + 30.0
    return kv.to(layout.torch_dtype)
