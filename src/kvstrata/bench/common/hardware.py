"""The raw hardware, measured on the same bytes as kvstrata in the same run: the baselines a
suite puts kvstrata next to, and the page cache dropped so that a read comes from the disk.

- :func:`cold_sequential_read_s`: one file of the size, read sequentially after its pages are
  dropped (what one big read of the same bytes costs);
- :func:`cold_parallel_read_s`: a set of files (a store's own block files) read whole, several
  reads in flight (a thread pool: ``readinto`` releases the GIL), after their pages are dropped;
- :func:`memcpy_s`: one tensor copy of the same bytes into a warm destination;
- :func:`write_fsync_s`: the bytes written to one new file and fsynced.
- :func:`on_each_cpu`: work run once on each CPU, so that memory is in the same state for every
  thread (the untimed read and drop before a cold read, the wake-up write before a timed one).

A store's data files are found by :func:`store_data_files` without knowing their layout (one
file per block, or segments holding many), so the baselines follow the store's format.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

READ_CHUNK_BYTES = 8 << 20
# Not block data: the liveness locks of processes, writes in progress, files that failed their check.
_NOT_DATA_DIRS = frozenset({"procs", "tmp", "quarantine"})


def store_data_files(root: Path) -> list[Path]:
    """The files that hold a store's block data: every file in its subdirectories, except the
    process locks, temp files and quarantine (the index and other metadata lie at the top)."""
    files: list[Path] = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and child.name not in _NOT_DATA_DIRS:
            files.extend(sorted(p for p in child.rglob("*") if p.is_file()))
    return files


def store_data_bytes(root: Path) -> int:
    """Bytes of a store's data files (what a cold restore of everything in it reads)."""
    return sum(path.stat().st_size for path in store_data_files(root))


def on_each_cpu(work: Callable[[], None]) -> None:
    """Run ``work`` once on each CPU this process may run on (in a thread pinned to it), one CPU
    after another; once in this thread where threads cannot be pinned.

    Why: the kernel keeps pages freed on a CPU in that CPU's own free list (per-cpu pages,
    auto-tuned here up to 1.3 GB), and this VM hands memory that sat free in the shared lists back
    to its host (free page reporting), so that using it again faults page by page. Memory freed
    on the main thread's CPU was ready for the main thread only: a checkpoint's writer thread, on
    the other CPU, wrote every other 2.9 MB record in 5-7 ms against 0.6 ms (write+fsync on the
    main thread: 0.55 ms each); the same memory prepared on each CPU, every record took 0.6-0.9."""
    if not hasattr(os, "sched_setaffinity"):
        work()
        return
    errors: list[BaseException] = []

    def pinned(cpu: int) -> None:
        try:
            os.sched_setaffinity(0, {cpu})  # 0: this thread alone
            work()
        except BaseException as error:  # re-raised in the caller
            errors.append(error)

    for cpu in sorted(os.sched_getaffinity(0)):
        thread = threading.Thread(target=pinned, args=(cpu,), name=f"kvstrata-bench-cpu{cpu}")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]


def drop_page_cache(paths: Iterable[Path]) -> None:
    """Write back and drop the files' pages from the page cache (``posix_fadvise(DONTNEED)``), so
    that the next read comes from the disk, into memory in the same state whatever came before.

    Each file is read once first (untimed), on each CPU (:func:`on_each_cpu`), so that dropping it
    frees its size in memory just before the timed read allocates as much page cache, on whichever
    CPU the reading thread runs. This VM hands memory freed a few seconds earlier back to its host
    (free page reporting), and such memory faults page by page when it is used again: in ``bench
    peers`` kvstrata's stores, whose checkpoints had dropped their pages seconds before, were read
    with the kernel copying at 0.6-0.8 GB/s (a 188 MB restore: 238 ms of CPU in ``preadv``), while
    llama.cpp's state file, still cached when dropped, read at 2 GB/s."""
    paths = list(paths)

    def read_and_drop() -> None:
        chunk = bytearray(READ_CHUNK_BYTES)
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped: write them back first
                while os.readv(fd, [chunk]):
                    pass
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    on_each_cpu(read_and_drop)


def drop_store_page_cache(root: Path) -> None:
    drop_page_cache(store_data_files(root))


def write_baseline_file(path: Path, nbytes: int) -> Path:
    """A file of ``nbytes`` random-looking bytes, fsynced (for the cold sequential read)."""
    import numpy as np

    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 256, size=max(1, min(nbytes, READ_CHUNK_BYTES)), dtype=np.uint8).tobytes()
    with path.open("wb") as file:
        left = nbytes
        while left > 0:
            file.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
        file.flush()
        os.fsync(file.fileno())
    return path


def _read_into(path: Path, view: memoryview) -> int:
    offset = 0
    with path.open("rb", buffering=0) as file:
        while offset < len(view):
            read = file.readinto(view[offset : offset + READ_CHUNK_BYTES])
            if not read:
                break
            offset += read
    return offset


def cold_sequential_read_s(path: Path, buffer: Any) -> float:
    """Seconds to read ``path`` sequentially into ``buffer`` (a writable bytearray/ndarray of its
    size, already paged in) after dropping its pages: a plain cold read of the same bytes."""
    drop_page_cache([path])
    view = memoryview(buffer).cast("B")
    started = time.perf_counter()
    _read_into(path, view)
    return time.perf_counter() - started


def cold_parallel_read_s(paths: Sequence[Path], buffer: Any, *, in_flight: int = 8) -> float:
    """Seconds to read every file of ``paths`` whole into its own slice of ``buffer`` (at least
    their total size, already paged in), ``in_flight`` reads at a time, after dropping their
    pages: the same files kvstrata reads, at the parallelism a fast restore would use."""
    drop_page_cache(paths)
    sizes = [path.stat().st_size for path in paths]
    view = memoryview(buffer).cast("B")
    if sum(sizes) > len(view):
        raise ValueError(f"buffer of {len(view)} bytes is too small for {sum(sizes)} bytes of files")
    slices = []
    offset = 0
    for path, size in zip(paths, sizes, strict=True):
        slices.append((path, view[offset : offset + size]))
        offset += size
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        started = time.perf_counter()
        read = sum(pool.map(lambda item: _read_into(*item), slices))
        elapsed = time.perf_counter() - started
    if read != sum(sizes):
        raise OSError(f"read {read} of {sum(sizes)} bytes of the store's files")
    return elapsed


def memcpy_s(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Seconds for one ``dst.copy_(src)`` (a plain memcpy of the same bytes, warm destination)."""
    started = time.perf_counter()
    dst.copy_(src)
    if dst.device.type == "cuda":
        import torch

        torch.cuda.synchronize(dst.device)
    return time.perf_counter() - started


def _write_fsync(path: Path, data: Any, flags: int) -> None:
    """``data`` written from the start of ``path`` (opened with ``flags``), then fsynced."""
    view = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        offset = 0
        while offset < len(view):
            offset += os.pwrite(fd, view[offset : offset + READ_CHUNK_BYTES], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def overwrite_fsync(path: Path, data: Any) -> None:
    """Write ``data`` over the start of ``path`` (created once, kept) and fsync it: disk writes
    without allocating or freeing blocks (a file removed just before a timed write frees its
    blocks in the journal commit the timed write then waits for)."""
    _write_fsync(path, data, 0)


def write_fsync_s(path: Path, data: Any) -> float:
    """Seconds to write ``data`` (a bytes-like object) to a new file ``path`` and fsync it: a plain
    durable write of the same bytes. ``path`` is removed afterwards (outside the timing)."""
    started = time.perf_counter()
    _write_fsync(path, data, os.O_TRUNC)
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed
