"""``kvstrata bench memory-modes`` on the tiny random Llama: the full mode attends to the whole
history, the lossy modes to their budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.bench.memory_modes import runner as memory_modes


@pytest.fixture(autouse=True)
def model_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTRATA_MODEL_CACHE", str(tmp_path / "model-cache"))


def test_memory_modes() -> None:
    budget = 256
    result = memory_modes.run(
        model="tiny",
        context_chars=1000,
        budget=budget,
        trials=1,
        decode=3,
        first_answer_tokens=1,
        progress=False,
    )
    modes = result.data["modes"]
    history = result.data["history_tokens"]
    assert history > 2 * budget
    assert modes[memory_modes.FULL]["attended"] == history
    for name in (f"window:{budget}", f"importance:{budget}"):
        # the kept blocks fit the budget (plus the partial tail block)
        assert modes[name]["attended"] <= budget + 64, name
    assert modes[memory_modes.FULL]["ttft_vs_full"] == 1.0
