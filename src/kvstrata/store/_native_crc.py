"""The native helpers of restores read straight into place (``crc32c_runs.c``): the reads of all
ranges in one call (:func:`preadv_ranges`), and the CRC32C over the runs of a record, in one call
(``crc32c_runs.c``): 5.2 GB/s run by run through the ``crc32c`` package (one call and one release
of the GIL per 16 KiB run), against one call per record here. The check of the last record of a
restore is on its critical path (it can only start once that record is read). The same call
checksums a large buffer (:func:`crc32c_of`: a record's payload as it is written, a whole record
read into a buffer). Built on first use (:mod:`kvstrata.native`); until then, and where it cannot
be, the ``crc32c`` package checks.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from kvstrata.native import NativeLibrary


def _setup(lib: ctypes.CDLL) -> str | None:
    lib.kvs_crc32c_supported.restype = ctypes.c_int
    lib.kvs_crc32c_supported.argtypes = []
    if not lib.kvs_crc32c_supported():
        return "this CPU has no SSE4.2 CRC32 instruction"
    lib.kvs_crc32c_runs.restype = ctypes.c_uint32
    lib.kvs_crc32c_runs.argtypes = [
        ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64
    ]  # fmt: skip
    # fds, count, offsets, first, iovs, done, after, released, start, step
    ranges = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 6, ctypes.c_int64, ctypes.c_int64]
    lib.kvs_preadv_ranges.restype = ctypes.c_int64
    lib.kvs_preadv_ranges.argtypes = ranges
    lib.kvs_preadv_ranges_start.restype = ctypes.c_void_p
    lib.kvs_preadv_ranges_start.argtypes = ranges
    lib.kvs_preadv_ranges_join.restype = None
    lib.kvs_preadv_ranges_join.argtypes = [ctypes.c_void_p]
    lib.kvs_resident_pages.restype = ctypes.c_int64
    lib.kvs_resident_pages.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.kvs_copy_runs.restype = ctypes.c_int64
    lib.kvs_copy_runs.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    lib.kvs_copy_crc32c_runs.restype = ctypes.c_uint32
    lib.kvs_copy_crc32c_runs.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int
    ]  # fmt: skip
    return None


LIBRARY = NativeLibrary("crc32c_runs", Path(__file__).with_name("crc32c_runs.c"), ["-O3", "-pthread"], _setup)


def crc32c_runs(crc: int, base: int, offsets: np.ndarray, run: int) -> int | None:
    """The CRC32C of ``run`` bytes at each ``base + offsets[i]`` (an int64 array) in order,
    continuing ``crc`` (the ``crc32c`` package's convention); None when the native library is not
    loaded (yet): the caller checks with the package. Starts the library's build on first use.
    The caller guarantees the memory is there (the runs of a live buffer)."""
    lib = LIBRARY.ready()
    if lib is None:
        return None
    if offsets.dtype != np.int64 or not offsets.flags.c_contiguous:
        raise ValueError("offsets must be a contiguous int64 array")
    return int(lib.kvs_crc32c_runs(crc, base, offsets.ctypes.data, len(offsets), run))


NATIVE_MIN_BYTES = 64 << 10
"""Below this a buffer is checked by the ``crc32c`` package (the native call's set-up costs more)."""
_ONE_RUN = np.zeros(1, dtype=np.int64)


def crc32c_of(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """The CRC32C of ``data`` continuing ``crc``: one native call for a large buffer (the GIL
    released throughout), the ``crc32c`` package otherwise or until the library is built. A
    record's payload is checked this way when it is written: the package took 46 us of the
    writer thread's ~190 a 256 KiB record (it gets the GIL back after every 32 KiB)."""
    view = memoryview(data)
    if view.nbytes >= NATIVE_MIN_BYTES and view.c_contiguous:
        address = np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data
        native = crc32c_runs(crc, address, _ONE_RUN, view.nbytes)
        if native is not None:
            return native
    return crc32c.crc32c(data, crc)


NOT_READ = np.iinfo(np.int64).min
"""``done[r]`` of a range :func:`preadv_ranges` has not read yet."""


@dataclass(frozen=True, slots=True)
class Gate:
    """Ranges that wait for others (buffers the caller reuses): range ``r`` is read only once
    ``released[after[r]]`` is positive (``after[r] < 0``: no wait); a negative ``released`` entry
    cancels the reads left (``-ECANCELED`` each). Both int64, one entry per range."""

    after: np.ndarray
    released: np.ndarray


def _checked(
    fds: np.ndarray,
    offsets: np.ndarray,
    first: np.ndarray,
    iovs: np.ndarray,
    done: np.ndarray,
    gate: Gate | None,
) -> list[int | None]:
    arrays = [(fds, np.int64), (offsets, np.int64), (first, np.int64), (iovs, np.uint64), (done, np.int64)]
    if gate is not None:
        arrays += [(gate.after, np.int64), (gate.released, np.int64)]
    for array, dtype in arrays:
        if array.dtype != dtype or not array.flags.c_contiguous:
            raise ValueError(f"preadv_ranges takes contiguous {np.dtype(dtype)} arrays")
    count = len(offsets)
    if len(first) != count + 1 or len(done) != count or len(fds) != count:
        raise ValueError("preadv_ranges: first needs one more entry than offsets, fds and done as many")
    inside = not count or 0 <= int(first[0]) <= int(first[-1]) <= len(iovs)
    if iovs.ndim != 2 or iovs.shape[1] != 2 or not inside:
        raise ValueError("preadv_ranges: first points outside iovs (rows of address, length)")
    if gate is not None:
        if len(gate.after) != count or len(gate.released) != count:
            raise ValueError("preadv_ranges: the gate needs one entry per range")
        waiting = np.flatnonzero(gate.after >= 0)
        if bool((gate.after[waiting] >= waiting).any()):  # a later range would never be read first
            raise ValueError("preadv_ranges: a range may only wait for an earlier one")
    pointers = [array.ctypes.data for array in (fds, offsets, first, iovs, done)]
    gated = [None, None] if gate is None else [array.ctypes.data for array in (gate.after, gate.released)]
    return [pointers[0], count, *pointers[1:], *gated]


def preadv_ranges(
    fds: np.ndarray,
    offsets: np.ndarray,
    first: np.ndarray,
    iovs: np.ndarray,
    done: np.ndarray,
    gate: Gate | None = None,
    *,
    start: int = 0,
    step: int = 1,
) -> bool:
    """Read ranges in one native call, the GIL released throughout: range ``r`` of file
    descriptor ``fds[r]`` (or ``-errno``: its file could not be opened) from file offset
    ``offsets[r]`` into the buffers ``iovs[first[r]:first[r + 1]]`` (rows of (address, length),
    uint64), then ``done[r]`` set to the bytes read or ``-errno`` (readers poll it;
    :data:`NOT_READ` until then); with ``gate``, ranges wait for the caller to release the ones
    before them (:class:`Gate`). Only ranges ``start, start + step, ...`` are read (several
    calls, each on a thread, keep several reads in flight). False, reading nothing, when the
    library is not loaded. The caller keeps every buffer alive until the call returns."""
    lib = LIBRARY.loaded()
    if lib is None:
        return False
    lib.kvs_preadv_ranges(*_checked(fds, offsets, first, iovs, done, gate), *_stride(start, step))
    return True


def start_preadv_ranges(
    fds: np.ndarray,
    offsets: np.ndarray,
    first: np.ndarray,
    iovs: np.ndarray,
    done: np.ndarray,
    gate: Gate | None = None,
    *,
    start: int = 0,
    step: int = 1,
) -> int | None:
    """:func:`preadv_ranges` on a native thread of its own, returning at once: a handle for
    :func:`join_preadv_ranges` (which the caller must call, and keep every array and buffer alive
    until then), or None when the library is not loaded or no thread could be started."""
    lib = LIBRARY.loaded()
    if lib is None:
        return None
    checked = _checked(fds, offsets, first, iovs, done, gate)
    handle: int | None = lib.kvs_preadv_ranges_start(*checked, *_stride(start, step))
    return handle


def _stride(start: int, step: int) -> tuple[int, int]:
    if start < 0 or step < 1:
        raise ValueError(f"preadv_ranges reads ranges start, start + step, ...: got {start}, {step}")
    return start, step


def join_preadv_ranges(handle: int) -> None:
    """Wait for the reads :func:`start_preadv_ranges` began (the GIL released) and free them."""
    lib = LIBRARY.loaded()
    assert lib is not None, "a handle comes from a loaded library"
    lib.kvs_preadv_ranges_join(handle)


def resident_pages(fd: int, offset: int, length: int) -> int | None:
    """How many pages of bytes ``[offset, offset + length)`` of the open file ``fd`` are in the
    page cache (``mincore`` over a mapping of them); None when the library is not loaded or the
    file cannot be mapped."""
    lib = LIBRARY.loaded()
    if lib is None:
        return None
    pages = int(lib.kvs_resident_pages(fd, offset, length))
    return pages if pages >= 0 else None


def _check_runs(dest: np.ndarray, src: np.ndarray, lens: np.ndarray) -> None:
    if any(a.dtype != np.int64 or not a.flags.c_contiguous or len(a) != len(dest) for a in (dest, src, lens)):
        raise ValueError("dest, src and lens must be contiguous int64 arrays of one length")


def copy_runs(dest: np.ndarray, src: np.ndarray, lens: np.ndarray, *, stream: bool) -> bool:
    """Copy ``lens[k]`` bytes from address ``src[k]`` to ``dest[k]`` for every k, in one native
    call (the GIL released); ``stream``: with non-temporal stores (for copies far larger than the
    caches). False when the library is not loaded (yet): the caller copies another way. The caller
    guarantees both sides are live memory that does not overlap (three int64 arrays, one entry a
    run)."""
    lib = LIBRARY.ready()
    if lib is None:
        return False
    _check_runs(dest, src, lens)
    lib.kvs_copy_runs(dest.ctypes.data, src.ctypes.data, lens.ctypes.data, len(dest), int(stream))
    return True


def copy_crc32c_runs(
    dest: np.ndarray, src: np.ndarray, lens: np.ndarray, crc: int, *, stream: bool
) -> int | None:
    """:func:`copy_runs` that also returns the CRC32C of the bytes copied (in order, continuing
    ``crc``), reading each source byte once; None when the library is not loaded (yet)."""
    lib = LIBRARY.ready()
    if lib is None:
        return None
    _check_runs(dest, src, lens)
    return int(
        lib.kvs_copy_crc32c_runs(
            dest.ctypes.data, src.ctypes.data, lens.ctypes.data, len(dest), crc, int(stream)
        )
    )
