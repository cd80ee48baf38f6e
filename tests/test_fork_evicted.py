"""A fork of a session whose older blocks a bounded L3 evicted (found by ``kvstrata bench soak``: the
fork's checkpoint failed with a 503): the fork ends before the first block no tier holds, its
checkpoint succeeds, and its KV is exactly the parent's up to there."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstrata import KVStore

from conftest import LAYOUT, token_kv

Factory = Callable[..., KVStore]


def test_a_fork_ends_before_the_first_block_no_tier_holds(open_store: Factory) -> None:
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    parent = store.create_session("parent")
    tokens = list(range(1, 15))  # three full blocks of four and a tail of two
    store.append(parent, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(parent)
    whole = store.fork(parent, "whole")
    assert whole.token_ids == tokens and whole.block_keys == parent.block_keys

    store.tiered.remove(parent.block_keys[1])  # evicted: no tier holds the second block
    child = store.fork(parent, "child")
    assert child.token_ids == tokens[:4] and child.block_keys == parent.block_keys[:1]
    assert child.tail_key is None and child.checkpointed_tokens == 4
    loaded = store.load(child)
    assert loaded.num_tokens == 4 and torch.equal(loaded.kv, token_kv(LAYOUT, tokens[:4]))  # type: ignore[arg-type]
    reopened = store.session("child")
    assert reopened.token_ids == tokens[:4]


def test_a_fork_without_its_tail_keeps_the_full_blocks(open_store: Factory) -> None:
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    parent = store.create_session("parent")
    tokens = list(range(1, 11))  # two full blocks and a tail of two
    store.append(parent, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(parent)
    assert parent.tail_key is not None
    store.tiered.remove(parent.tail_key)
    child = store.fork(parent, "child")
    assert child.token_ids == tokens[:8] and child.block_keys == parent.block_keys
    assert child.tail_key is None
