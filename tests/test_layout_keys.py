from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvstrata import ConfigError, KVLayout
from kvstrata.keys import chain_key, chain_keys, key_from_hex, root_key


def test_layout_sizes() -> None:
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_tokens=64)
    assert layout.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert layout.bytes_per_block == 46_080 * 64
    assert layout.block_shape(5) == (2, 30, 3, 5, 64)
    assert KVLayout.from_json(layout.to_json()) == layout
    assert KVLayout.from_json(layout.to_json()).fingerprint == layout.fingerprint


def test_layout_fingerprint_changes_with_each_field() -> None:
    base = KVLayout(2, 2, 8, "float32", 4)
    variants = [
        KVLayout(3, 2, 8, "float32", 4),
        KVLayout(2, 1, 8, "float32", 4),
        KVLayout(2, 2, 16, "float32", 4),
        KVLayout(2, 2, 8, "float16", 4),
        KVLayout(2, 2, 8, "float32", 8),
    ]
    assert len({base.fingerprint, *(v.fingerprint for v in variants)}) == 6


@pytest.mark.parametrize(
    "kwargs", [{"num_layers": 0}, {"head_dim": -1}, {"dtype": "int8"}, {"block_tokens": 0}]
)
def test_layout_rejects_bad_values(kwargs: dict[str, object]) -> None:
    args = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float32",
        "block_tokens": 4,
        **kwargs,
    }
    with pytest.raises(ConfigError):
        KVLayout(**args)  # type: ignore[arg-type]


def test_check_block(layout: KVLayout) -> None:
    layout.check_block(torch.zeros(layout.block_shape(3)))
    with pytest.raises(ConfigError):
        layout.check_block(torch.zeros(layout.block_shape(3), dtype=torch.float16))
    with pytest.raises(ConfigError):
        layout.check_block(torch.zeros((2, 3, 2, 4, 8)))
    with pytest.raises(ConfigError):
        layout.check_block(torch.zeros(layout.block_shape(5)))


def test_chain_keys_share_prefixes_and_split_namespaces(layout: KVLayout) -> None:
    root_a = root_key(b"model", layout, "tenant-a")
    tokens = list(range(10))
    keys = chain_keys(root_a, tokens, 4)
    assert len(keys) == 2
    assert keys == chain_keys(root_a, [*tokens[:8], 99, 98], 4)  # same full blocks, other tail
    assert chain_keys(root_a, [1, *tokens[1:]], 4)[1] != keys[1]  # a changed token changes every later key
    assert chain_keys(root_key(b"model", layout, "tenant-b"), tokens, 4)[0] != keys[0]
    assert chain_keys(root_key(b"other-model", layout, "tenant-a"), tokens, 4)[0] != keys[0]
    assert chain_key(root_a, [1, 2]) != chain_key(root_a, [1, 2, 0])  # length is part of the hash
    assert key_from_hex(keys[0].hex()) == keys[0]


def test_keys_are_stable_across_processes(layout: KVLayout) -> None:
    """Keys must not depend on PYTHONHASHSEED or the process: computed in a child, they match."""
    code = (
        "from kvstrata.keys import chain_key, root_key; from kvstrata import KVLayout;"
        "l = KVLayout(2, 2, 8, 'float32', 4);"
        "print(chain_key(root_key(b'model', l, 'ns'), [1, 2, 3, 4]).hex())"
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    )
    assert child.stdout.strip() == chain_key(root_key(b"model", layout, "ns"), [1, 2, 3, 4]).hex()
