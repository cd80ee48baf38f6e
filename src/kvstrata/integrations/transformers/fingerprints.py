"""Model fingerprints: the digest of a model's weights and architecture config that keys its KV.

Every KV block kvstrata stores carries the fingerprint of the weights that computed it, so KV is
never served to another model (a fine-tune, a re-quantisation). :func:`fingerprint_model_dir`
hashes the bytes of every ``*.safetensors`` file and config.json less its bookkeeping keys; the
digest is cached by file identity (path, size, mtime, inode) in ``<model cache>/fingerprints.json``,
so a model is hashed once, not on every load. The model cache's root: the ``cache_dir`` argument,
else ``$KVSTRATA_MODEL_CACHE``, else ``platformdirs.user_cache_dir("kvstrata")/models``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import platformdirs

from kvstrata.errors import ConfigError

logger = logging.getLogger(__name__)

MODEL_CACHE_ENV = "KVSTRATA_MODEL_CACHE"
FINGERPRINT_BYTES = 32

_DIGEST_CACHE_NAME = "fingerprints.json"
_DIGEST_CACHE_VERSION = 1
_HASH_CHUNK_BYTES = 8 << 20
# A file modified this close to the moment it was hashed could be rewritten again within the same
# mtime tick without its identity changing, so such a digest is not cached (git's "racy clean").
_RACY_WINDOW_NS = 2_000_000_000
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


def model_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Root of converted models and cached digests: the argument, ``$KVSTRATA_MODEL_CACHE``, or the
    per-user cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from_env = os.environ.get(MODEL_CACHE_ENV)
    if from_env:
        return Path(from_env).expanduser()
    return Path(platformdirs.user_cache_dir("kvstrata")) / "models"


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
    weights = weight_files(model_dir)
    if not weights:
        raise ConfigError(f"{model_dir} has no *.safetensors weight files")
    return cached_digest(
        model_cache_dir(cache_dir),
        kind="model",
        path=model_dir,
        files=[config_path, *weights],
        compute=lambda: _hash_model_files(config_path, weights),
    )


def weight_files(model_dir: Path) -> list[Path]:
    """The ``*.safetensors`` files of a model directory, sorted by name."""
    return sorted(path for path in model_dir.glob("*.safetensors") if path.is_file())


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def _hash_stream(hasher: Any, path: Path, buffer: bytearray) -> None:
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as file:
        while read := file.readinto(buffer):
            hasher.update(view[:read])


def _hash_model_files(config_path: Path, weights: Sequence[Path]) -> bytes:
    config = read_json_object(config_path)
    relevant = {key: value for key, value in config.items() if key not in _CONFIG_KEYS_IGNORED}
    config_bytes = json.dumps(relevant, sort_keys=True, separators=(",", ":")).encode()
    hasher = hashlib.blake2b(digest_size=FINGERPRINT_BYTES, person=b"kvstrata-model")
    hasher.update(len(config_bytes).to_bytes(8, "little"))
    hasher.update(config_bytes)
    buffer = bytearray(_HASH_CHUNK_BYTES)
    try:
        for path in weights:
            # The length frames each file, so bytes cannot shift between shards unnoticed.
            hasher.update(path.stat().st_size.to_bytes(8, "little"))
            _hash_stream(hasher, path, buffer)
    except OSError as exc:
        raise ConfigError(f"cannot read weights in {config_path.parent}: {exc}") from exc
    return hasher.digest()


def hash_gguf_file(gguf: Path) -> bytes:
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


def cached_digest(
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
