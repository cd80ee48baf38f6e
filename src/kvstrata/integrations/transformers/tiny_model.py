"""The tiny random Llama of the tests and examples: fixed seed, fast forward, no download."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.conversion import transformers_progress
from kvstrata.integrations.transformers.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer


def tiny_llama(
    seed: int = 0,
    *,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = TINY_VOCAB_SIZE,
    max_positions: int = 4096,
) -> LlamaForCausalLM:
    """A randomly initialised fp32 eager ``LlamaForCausalLM``; the same seed gives the same weights.

    Token ids 0 (bos, pad) and 2 (eos) match :func:`tiny_tokenizer`. The caller's RNG state is
    left as it was.
    """
    for name, value in (
        ("num_layers", num_layers),
        ("hidden", hidden),
        ("heads", heads),
        ("kv_heads", kv_heads),
        ("max_positions", max_positions),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"tiny_llama: {name} must be a positive integer, got {value!r}")
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ConfigError(
            f"tiny_llama: hidden ({hidden}) % heads ({heads}) and heads % kv_heads ({kv_heads}) must be 0, "
            "and the head dim even (rotary embeddings rotate pairs)"
        )
    if vocab < 3:
        raise ConfigError(f"tiny_llama: vocab must hold the special ids 0..2, got {vocab}")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def save_tiny_llama(
    directory: str | Path,
    seed: int = 0,
    *,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 4096,
) -> Path:
    """Save :func:`tiny_llama` with :func:`tiny_tokenizer` as a model directory for :func:`load_model`."""
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(
        seed,
        num_layers=num_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        max_positions=max_positions,
    )
    with transformers_progress(False):  # no "Writing model shards" bar for a tiny model
        model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
