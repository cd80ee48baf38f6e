"""The importance tracker (attention mass per block) and the memory-mode harness, on the tiny Llama."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstrata.eval.eviction import MODES, choose_blocks, evaluate_eviction
from kvstrata.integrations.transformers.importance import ImportanceTracker
from kvstrata.integrations.transformers.model import load_model, save_tiny_llama, tiny_llama


@torch.inference_mode()
def test_tracker_leaves_logits_unchanged_and_counts_all_attention_mass() -> None:
    model = tiny_llama(0)
    tracker = ImportanceTracker(block_tokens=16)
    ids = torch.randint(3, 200, (1, 70), generator=torch.Generator().manual_seed(0))
    reference = model(ids).logits
    with tracker.attached(model):
        tracked = model(ids).logits
    assert model.config._attn_implementation == "eager"  # restored afterwards
    torch.testing.assert_close(tracked, reference, atol=1e-6, rtol=0)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert tracker.block_mass.numel() == 5  # 70 tokens in blocks of 16: one float per block
    assert abs(tracker.block_mass.sum().item() - layers * heads * 70) < 1e-4  # every row of softmax sums to 1
    # causal attention: the first token is seen by all 70 queries, the last block's by few
    assert tracker.block_mass[0] > tracker.block_mass[-1]
    assert torch.isclose(tracker.normalized(5).sum(), torch.tensor(1.0, dtype=torch.float64))


def test_block_choices() -> None:
    scores = torch.tensor([0.9, 0.1, 0.8, 0.05, 0.7, 0.3, 0.2, 0.4], dtype=torch.float64)
    assert choose_blocks("full", scores, 4) == list(range(8))
    assert choose_blocks("recent", scores, 4) == [4, 5, 6, 7]
    assert choose_blocks("sinks+recent", scores, 4) == [0, 5, 6, 7]
    assert choose_blocks("importance", scores, 4) == [0, 2, 4, 7]  # sink, newest, then top scores


def test_memory_modes_harness_runs(tmp_path: Path) -> None:
    loaded = load_model(save_tiny_llama(tmp_path / "m", seed=1), progress=False)
    ids = torch.randint(3, 250, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = evaluate_eviction(loaded, ids, context_tokens=128, eval_tokens=8, block_tokens=16)
    assert [r.mode for r in rows] == list(MODES)
    full = rows[0]
    assert full.ppl_delta_pct == 0.0 and full.kl == 0.0 and full.top1 == 1.0
    assert all(len(r.kept_blocks) == 4 for r in rows[1:])  # half of the 8 blocks
