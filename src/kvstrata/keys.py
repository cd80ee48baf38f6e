"""Content-addressed block keys.

A block's key is a chained hash over (model fingerprint, layout, namespace, parent key, token
ids), so identical prefixes in one namespace give identical keys (stored once), different
namespaces or models never share a key, and a key can be recomputed in any process on any
machine (blake2b over explicit little-endian bytes; never Python's ``hash()``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NewType

import numpy as np

from kvstrata.errors import ConfigError

if TYPE_CHECKING:  # keys are computed from a layout's fingerprint; the layout module loads torch
    from kvstrata.layout import KVLayout

BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 32
_ROOT_PERSON = b"kvstrata-root"
_BLOCK_PERSON = b"kvstrata-block"
_PRUNED_PERSON = b"kvstrata-pruned"
LINEAGE_BYTES = 16


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    array = np.asarray(token_ids, dtype=np.int64)
    if array.ndim != 1:
        raise ConfigError("token ids must be a flat sequence")
    if array.size and (array.min() < 0 or array.max() > 0xFFFFFFFF):
        raise ConfigError("token ids must be in 0..2**32-1")
    return array.astype("<u4").tobytes()


def root_key(model_fingerprint: bytes, layout: KVLayout, namespace: str) -> BlockKey:
    """The key every chain in (model, layout, namespace) starts from."""
    if not namespace or "\x00" in namespace:
        raise ConfigError(f"invalid namespace {namespace!r}")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_ROOT_PERSON)
    for part in (model_fingerprint, layout.fingerprint, namespace.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return BlockKey(h.digest())


def chain_key(parent: BlockKey, token_ids: Sequence[int] | np.ndarray) -> BlockKey:
    """Key of the block holding ``token_ids`` that follows the block (or root) ``parent``."""
    tokens = _token_bytes(token_ids)
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_BLOCK_PERSON)
    h.update(parent)
    h.update((len(tokens) // 4).to_bytes(4, "little"))
    h.update(tokens)
    return BlockKey(h.digest())


def pruned_parent(parent: BlockKey, lineage: bytes) -> BlockKey:
    """The parent a session's first block computed over a *pruned* context chains from.

    A lossy memory mode (a sliding window, an importance budget) computes new tokens' KV while
    attending to only part of the history, so that KV differs from the exact KV of the same
    tokens. Chaining it from ``pruned_parent(parent, lineage)`` (``lineage``: random bytes the
    session drew when it first pruned) gives it keys that can never equal an exact block's key or
    another session's, while every later block still chains from it as usual.
    """
    if len(lineage) != LINEAGE_BYTES:
        raise ConfigError(f"a lineage has {LINEAGE_BYTES} bytes, got {len(lineage)}")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PRUNED_PERSON)
    h.update(parent)
    h.update(lineage)
    return BlockKey(h.digest())


def block_parent(
    parent: BlockKey, block_start: int, num_tokens: int, lineage: bytes | None, lineage_from: int | None
) -> BlockKey:
    """The parent to chain the block of tokens ``block_start .. +num_tokens`` from: ``parent``,
    or its pruned variant for the block that holds token ``lineage_from`` (the first token whose
    KV was computed over a pruned context)."""
    if lineage is None or lineage_from is None:
        return parent
    if block_start <= lineage_from < block_start + num_tokens:
        return pruned_parent(parent, lineage)
    return parent


def session_chain(
    root: BlockKey,
    token_ids: Sequence[int] | np.ndarray,
    block_tokens: int,
    lineage: bytes | None = None,
    lineage_from: int | None = None,
) -> tuple[list[BlockKey], BlockKey | None]:
    """The keys of a session's full blocks and of its partial tail (None if it has none)."""
    array = np.asarray(token_ids, dtype=np.int64)
    keys: list[BlockKey] = []
    parent = root
    for start in range(0, len(array), block_tokens):
        chunk = array[start : start + block_tokens]
        key = chain_key(block_parent(parent, start, len(chunk), lineage, lineage_from), chunk)
        if len(chunk) < block_tokens:
            return keys, key
        keys.append(key)
        parent = key
    return keys, None


def chain_keys(root: BlockKey, token_ids: Sequence[int] | np.ndarray, block_tokens: int) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` (a trailing partial block is not included)."""
    array = np.asarray(token_ids, dtype=np.int64)
    keys: list[BlockKey] = []
    parent = root
    for start in range(0, len(array) - block_tokens + 1, block_tokens):
        parent = chain_key(parent, array[start : start + block_tokens])
        keys.append(parent)
    return keys


def key_hex(key: bytes) -> str:
    return key.hex()


def key_from_hex(text: str) -> BlockKey:
    try:
        raw = bytes.fromhex(text)
    except ValueError as exc:
        raise ConfigError(f"invalid block key {text!r}") from exc
    if len(raw) != KEY_BYTES:
        raise ConfigError(f"a block key has {KEY_BYTES} bytes, got {len(raw)}")
    return BlockKey(raw)
