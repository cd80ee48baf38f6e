"""A native decode-attention kernel for batched steps on CPU (fp32 or bf16 KV), built on first use.

Why: in a batched step of SmolLM2 on a 2-core CPU, the per-row attention of the decode rows
(torch's sdpa, one call per row and layer, its 2 threads splitting a row's 3 key/value heads) was
about a third of the step: 44-47 ms of a 16-row step in fp32 and in bf16 alike, 480 kernel calls
that read 425 MB of fp32 KV at about 10 GB/s where the machine reads 28. ``decode_attention.cpp``
runs all decode rows of a layer in one call, one (row, kv head) per thread at a time, with AVX-512
arithmetic (the common shapes compiled with their sizes fixed, so queries and accumulators stay in
registers): 23.5 ms for the same rows in fp32, 22 ms in bf16 (alternated in one process,
2026-11-30). bf16 keys and values are read as they are and computed in fp32, as sdpa's bf16
kernel does. The same module carries the elementwise operations of the Llama step
(``layer_ops.cpp``, :mod:`.llama`).

How it is built: with torch's C++ extension loader (``torch.utils.cpp_extension.load``: a C++
compiler and ninja), once per machine and torch version, cached in torch's extensions directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); a build takes about half a
minute on 2 cores and runs in a background thread, the steps using sdpa until it is loaded.
A build found there (:func:`built`) is loaded before a batched forward's first step instead, so
that a process's requests all run one implementation.
Where it cannot be used (no compiler or ninja, a CPU without AVX-512, a failed build, or
``KVSTRATA_NATIVE_KERNELS=0``) the batched step keeps sdpa, and :func:`status` says why.

Results: a row's output depends only on that row (no reduction across rows or threads), so a
batched step and the same row alone give the same bits; against sdpa they differ by float
rounding (about 1e-7; the exactness tests compare batched with unbatched runs).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvstrata.native import ENV, BackgroundBuild

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
LAYER_OPS_SOURCE = Path(__file__).with_name("layer_ops.cpp")
"""The elementwise parts of a batched Llama step (:mod:`.llama`), built into the same module."""
STEP_SOURCE = Path(__file__).with_name("decode_step.cpp")
"""A Llama decode step's decoder layers in one call (:mod:`.llama`), built into the same module."""
SOURCES = (SOURCE, LAYER_OPS_SOURCE, STEP_SOURCE)
NAME = f"kvstrata_decode_attention_{hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]}"
"""One build per environment: a build compiles against its environment's torch headers, and two
environments sharing one build directory (the project's venv and vLLM's) rebuilt it in turn."""
CFLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math"]
MAX_GROUP, MAX_HEAD_DIM = 8, 256  # the source's kMaxGroup and kMaxChunks * 16


def loaded() -> ModuleType | None:
    """The kernel's module once it is built and loaded, else None (never blocks)."""
    return _KERNEL.loaded()


def status() -> str:
    """``loaded``, ``building``, ``not built``, or why the kernel is not used."""
    return _KERNEL.status()


def start() -> None:
    """Build and load the kernel in a background thread (once per process; no-op after)."""
    _KERNEL.start()


def load(timeout: float | None = None) -> ModuleType | None:
    """Build and load the kernel now (waiting at most ``timeout`` seconds); None if unavailable."""
    return _KERNEL.load(timeout)


def built() -> bool:
    """Whether torch's extensions directory holds a build of these sources (loading it takes a
    few tens of milliseconds, not a compile): its library is newer than both sources and its
    ninja file names them. A guess on the safe side: where it says yes, torch's loader may still
    find something to rebuild, and where it says no, the kernel is built in the background."""
    from torch.utils.cpp_extension import _get_build_directory  # where load() builds

    try:
        directory = Path(_get_build_directory(NAME, False))
        built_at = (directory / f"{NAME}.so").stat().st_mtime
        ninja = (directory / "build.ninja").read_text()
        sources = [(str(source), source.stat().st_mtime) for source in SOURCES]
    except OSError:
        return False
    return all(path in ninja and mtime <= built_at for path, mtime in sources)


def _unavailable() -> str | None:
    if os.environ.get(ENV, "1") == "0":
        return f"turned off ({ENV}=0)"
    for source in SOURCES:
        if not source.is_file():
            return f"the kernel's source is missing ({source})"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found)"
    if not _ninja_on_path():
        return "ninja is not installed (pip install ninja)"
    return None


def _ninja_on_path() -> bool:
    """torch's loader runs ``ninja`` from PATH; the ninja wheel (a dependency) puts it in the
    environment's scripts directory, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is not None:
        return True
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return False
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    return shutil.which("ninja") is not None


def _build() -> tuple[ModuleType | None, str]:
    from torch.utils.cpp_extension import _get_build_directory  # where load() builds
    from torch.utils.cpp_extension import load as load_extension

    try:
        directory = Path(_get_build_directory(NAME, False))
        with _builder_lock(directory):
            _clear_left_lock(directory)
            sources = [str(source) for source in SOURCES]
            module = load_extension(NAME, sources, extra_cflags=CFLAGS, verbose=False)
    except Exception as exc:  # a compiler error, a broken toolchain: sdpa keeps working
        log.warning("the native decode-attention kernel failed to build; using sdpa\n%s", exc)
        errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
        return None, f"build failed: {(errors or [type(exc).__name__])[0].strip()}"
    if not module.supported():
        return None, "this CPU has no AVX-512"
    return module, "loaded"


@contextlib.contextmanager
def _builder_lock(directory: Path) -> Iterator[None]:
    """kvstrata's own lock around torch's loader, held by one process at a time: an ``flock``,
    which the kernel releases when its holder dies (torch's own lock is a file that a killed
    build leaves behind, and its loader then waits for it forever)."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "kvstrata.flock").open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _clear_left_lock(directory: Path) -> None:
    """Remove torch's build lock, under :func:`_builder_lock`: no kvstrata build is running, so a
    lock there was left by a process that exited or was killed while loading (a CLI command that
    ended, a test's server stopped mid-build)."""
    lock = directory / "lock"
    if lock.exists():
        # routine, not a warning: torch's loader takes that lock even to find a build up to date,
        # and a short command (a `kvstrata chat` turn) may exit while its background load holds it
        log.info("removing %s, left by a kernel load that did not finish", lock)
        lock.unlink(missing_ok=True)


_KERNEL: BackgroundBuild[ModuleType] = BackgroundBuild(
    "decode-attention kernel", lambda: _unavailable(), lambda: _build()
)


def fits(config: Any) -> bool:
    """Whether a model's attention shape is one the kernel takes: head_dim a multiple of 16 up to
    256, and 1 to 8 query heads per key/value head."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    group, rest = divmod(heads, kv_heads)
    return rest == 0 and 1 <= group <= MAX_GROUP and head_dim % 16 == 0 and 16 <= head_dim <= MAX_HEAD_DIM


def decode_attention(
    module: ModuleType,
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    scaling: float,
    pages: PagedRows | None = None,
    masses: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rows' one-query attention: ``query`` ``(rows, heads, head_dim)`` against each row's
    ``(1, kv_heads, length, head_dim)`` exact keys and values (float32 or bfloat16, all alike)
    and, with ``pages``, each row's encoded blocks (resident pages, read in place); returns
    ``(rows, heads, head_dim)`` in the query's dtype (the arithmetic is float32). ``masses``: per
    row a float32 ``(kv_heads, >= tokens)`` tensor (or an empty one) to which each token's
    attention probability is added, pages first (in table order), then exact tokens."""
    rows, heads, dim = query.shape
    kv_heads = keys[0].shape[1]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    if grouped.dtype not in (torch.float32, torch.bfloat16):
        grouped = grouped.float()
    if pages is None:
        out = module.decode_attention(grouped, keys, values, scaling, masses=masses or [])
    else:
        out = module.decode_attention(
            grouped,
            keys,
            values,
            scaling,
            pages.arenas,
            pages.tables,
            pages.layer,
            pages.num_layers,
            masses or [],
        )
    out = out.view(rows, heads, dim)  # in the dtype of the query it was given
    return out if out.dtype == query.dtype else out.to(query.dtype)


@dataclass(frozen=True, slots=True)
class PagedRows:
    """The rows' encoded blocks for one kernel call: per row its page arena (uint8) and page table
    (int64 ``(pages, 4)``, :mod:`kvstrata.codecs.pages`), empty for a row with none, read at
    ``layer`` of ``num_layers``."""

    arenas: list[torch.Tensor]
    tables: list[torch.Tensor]
    layer: int
    num_layers: int
