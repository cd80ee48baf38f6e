"""Moving KV bytes: host copies that run at memory speed, and host-to-device copies that overlap.

Two facts decide how the data path copies:

- On the CPU, torch's ``Tensor.copy_`` splits a copy across its intra-op threads; for the many
  ~MB copies of a restore, run from several reader threads at once, that costs 2-30x (threads
  spin and wait for one another; measured on this 2-core machine: 0.1-0.3 GB/s with 2 intra-op
  threads against 3-6 GB/s with numpy's single-threaded copy). Host copies therefore go through
  numpy (``np.copyto``), which copies in the calling thread and releases the GIL, so reader
  threads copy in parallel.
- To a CUDA device, a copy from pageable memory is synchronous. :class:`DeviceCopier` decodes into
  pinned staging buffers and issues ``non_blocking`` copies on a side stream, two staging buffers
  per reader thread (one being copied while the next block is read); the caller's stream waits for
  the side stream at the end. On the CPU the same object copies directly (no staging, no stream),
  so one code path serves both and is tested on machines without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from kvstrata.layout import FP8_TORCH_DTYPES

_NUMPY_VIEW = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,  # numpy has no bfloat16: copy the bits
    **dict.fromkeys(FP8_TORCH_DTYPES, np.uint8),  # nor fp8
    torch.float64: np.float64,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
}

_BITS = {torch.bfloat16: torch.int16, **dict.fromkeys(FP8_TORCH_DTYPES, torch.uint8)}
"""Float dtypes numpy lacks, viewed as integers of their width (then as ``_NUMPY_VIEW`` says)."""


def has_host_array(tensor: torch.Tensor) -> bool:
    """Whether :func:`host_array` can view ``tensor``: on the CPU, no autograd history, a dtype
    numpy can hold the bits of."""
    return tensor.device.type == "cpu" and not tensor.requires_grad and tensor.dtype in _NUMPY_VIEW


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (any dtype torch stores in 8-64 bits; bfloat16 as uint16)."""
    view_dtype = _NUMPY_VIEW[tensor.dtype]
    if tensor.dtype in _BITS:
        tensor = tensor.view(_BITS[tensor.dtype])
    array = tensor.numpy()
    return array if array.dtype == view_dtype else array.view(view_dtype)


def copy_tensor(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest[...] = src`` (same shape and dtype); host to host through numpy, in this thread."""
    if dest.device.type == "cpu" and src.device.type == "cpu" and dest.dtype == src.dtype:
        np.copyto(host_array(dest), host_array(src))
    else:
        dest.copy_(src)


def copy_bytes(dest: torch.Tensor, payload: bytes | bytearray | memoryview) -> None:
    """Fill the CPU tensor ``dest`` from ``payload``, the raw bytes of a C-contiguous tensor of
    ``dest``'s shape and dtype (no intermediate copy)."""
    array = host_array(dest)
    src = np.frombuffer(payload, dtype=array.dtype).reshape(array.shape)
    np.copyto(array, src)


class DeviceCopier:
    """Copies host blocks into a destination on ``device``, overlapping transfers with reads.

    ``stage(shape, dtype)`` gives the calling thread a host buffer to decode into (pinned, for a
    CUDA destination); ``commit(dest, staged)`` copies it to ``dest`` (asynchronously on a side
    stream for CUDA; at once on the CPU). Each thread owns two staging buffers per shape and
    reuses one only after its previous copy finished. ``finish()`` makes the caller's stream wait
    for every copy issued; call it before using the destination.
    """

    def __init__(self, device: torch.device | str, *, staged: bool = False) -> None:
        """``staged``: decode host blocks into staging buffers even for a CPU destination (the
        CUDA path's logic, run where there is no GPU: tests use it)."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.staged = staged or self.cuda
        self._local = threading.local()
        self._streams: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()

    # -- per-thread state ------------------------------------------------------------------------
    def _state(self) -> dict[str, object]:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = {"buffers": {}, "turn": 0, "events": [None, None], "stream": None}
            if self.cuda:
                stream = torch.cuda.Stream(device=self.device)
                state["stream"] = stream
                with self._lock:
                    self._streams.append(stream)
        return state

    def stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of ``shape``/``dtype`` this thread may fill now (on the CPU with a CPU
        destination: None is never returned; the buffer is this thread's own)."""
        state = self._state()
        turn = int(state["turn"])  # type: ignore[call-overload]
        events: list[object] = state["events"]  # type: ignore[assignment]
        event = events[turn]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]  # the copy out of this buffer is done
        buffers: dict[tuple[object, ...], torch.Tensor] = state["buffers"]  # type: ignore[assignment]
        key = (turn, tuple(shape), dtype)
        buffer = buffers.get(key)
        if buffer is None:
            buffer = buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
        return buffer

    def commit(self, dest: torch.Tensor, staged: torch.Tensor) -> None:
        """Copy ``staged`` (from ``stage``) into ``dest``."""
        if not self.cuda:
            copy_tensor(dest, staged)
            return
        state = self._state()
        stream: torch.cuda.Stream = state["stream"]  # type: ignore[assignment]
        with torch.cuda.stream(stream):
            dest.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        turn = int(state["turn"])  # type: ignore[call-overload]
        state["events"][turn] = event  # type: ignore[index]
        state["turn"] = 1 - turn

    def finish(self) -> None:
        """The caller's stream waits for every copy issued (no-op on the CPU)."""
        if not self.cuda:
            return
        current = torch.cuda.current_stream(self.device)
        with self._lock:
            for stream in self._streams:
                current.wait_stream(stream)


def parallel_map(pool: object, fn: Callable[[int], object], count: int) -> list[object]:
    """``[fn(i) for i in range(count)]`` on ``pool`` (a ThreadPoolExecutor), in order."""
    futures = [pool.submit(fn, i) for i in range(count)]  # type: ignore[attr-defined]
    return [f.result() for f in futures]
