"""Helpers shared by the ``agents`` and ``trace`` bench suites: the model to run, a progress bar
on stderr, the store's memory per tier, and a plain greedy loop over a transformers cache."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    from kvstrata.integrations.transformers.model import LoadedModel
    from kvstrata.store import KVStore

TINY = "tiny"
"""``--model tiny``: the tiny random Llama of the tests (byte tokenizer, random weights)."""


def load_bench_model(
    spec: str | None, workdir: Path, *, tiny_layers: int = 2, tiny_hidden: int = 64
) -> LoadedModel:
    """SmolLM2 (``spec`` None), the tiny random Llama (``"tiny"``), or a model directory / GGUF."""
    from kvstrata.cli.progress import stderr_is_terminal
    from kvstrata.integrations.transformers.model import load_model, save_tiny_llama

    if spec == TINY:
        heads = max(tiny_hidden // 16, 2)
        directory = save_tiny_llama(
            workdir / "tiny-model",
            seed=0,
            num_layers=tiny_layers,
            hidden=tiny_hidden,
            heads=heads,
            kv_heads=2,
        )
        return load_model(directory, progress=False)
    return load_model(spec, attn_implementation="sdpa", progress=stderr_is_terminal())


@contextlib.contextmanager
def workdir(path: Path | None, prefix: str) -> Iterator[Path]:
    """``path`` (created, kept), or a temporary directory removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def tier_bytes(store: KVStore) -> dict[str, int]:
    """Bytes the store's tiers hold now: L1 and L2 used bytes (memory), L3 stored bytes (disk)."""
    usage = {level.name: u for level, u in store.tier_usage().items()}
    return {"L1": usage["L1"].used_bytes, "L2": usage["L2"].used_bytes, "L3": usage["L3"].stored_bytes}


def tier_hits(store: KVStore) -> dict[str, int]:
    from kvstrata.store.tiers.base import TierLevel

    counters = store.counters.tiers
    return {level.name: counters[level].hits for level in (TierLevel.L1, TierLevel.L2, TierLevel.L3)}


def stop_ids(model: LoadedModel) -> set[int]:
    eos = model.model.generation_config.eos_token_id
    if eos is None:
        eos = model.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def forward_logits(model: LoadedModel, token_ids: Sequence[int], cache: Any) -> Any:
    """Last-position logits after feeding ``token_ids`` into a transformers ``cache``."""
    import torch

    device = model.model.get_input_embeddings().weight.device
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    out = model.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):,.1f}"


def fmt_ms(value: float) -> str:
    return "-" if value != value else f"{value:,.0f}"


def check_positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
