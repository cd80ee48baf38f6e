"""llama.cpp's side of ``kvstrata bench peers``: its own sequence state save and restore
(``llama-cpp-python``), on the GGUF itself.

llama-cpp-python is an optional extra (it compiles llama.cpp, for many minutes on a small
machine): ``pip install 'kvstrata[peers]'``. Models load with ``use_extra_bufts = False``:
llama.cpp's weight repacking for AMX segfaults on some virtual machines' Intel CPUs, and a state
save and restore does not depend on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstrata.bench.common.hardware import drop_page_cache
from kvstrata.errors import ConfigError

LLAMA_CPP_REQUIREMENT = "llama-cpp-python==0.3.36"
INSTALL_HINT = (
    "kvstrata bench peers needs llama-cpp-python, an optional extra that compiles llama.cpp "
    f"(several minutes): pip install 'kvstrata[peers]'   (or: pip install {LLAMA_CPP_REQUIREMENT}); "
    "--kvstrata-only measures kvstrata's side alone"
)


def require_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or a ConfigError that says how to install the extra."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc


@contextlib.contextmanager
def _no_extra_buffer_types(llama_cpp: Any) -> Iterator[None]:
    """Models loaded meanwhile get ``use_extra_bufts = False`` (the high-level ``Llama`` class has
    no argument for it: it asks ``llama_model_default_params`` and sets what it knows)."""
    low_level = llama_cpp.llama_cpp
    default = low_level.llama_model_default_params

    def params() -> Any:
        value = default()
        if hasattr(value, "use_extra_bufts"):
            value.use_extra_bufts = False
        return value

    low_level.llama_model_default_params = params
    try:
        yield
    finally:
        low_level.llama_model_default_params = default


class LlamaSide:
    """Two contexts on one GGUF: ``saver`` prefills and saves, ``restorer`` restores (cleared
    before each restore, so it starts as a fresh context would)."""

    def __init__(self, llama_cpp: Any, gguf: Path, n_ctx: int, threads: int) -> None:
        self.lib = llama_cpp
        kwargs = dict(
            model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
            n_threads_batch=threads, verbose=False,
        )  # fmt: skip
        with _no_extra_buffer_types(llama_cpp):
            self.saver = llama_cpp.Llama(**kwargs)
            self.restorer = llama_cpp.Llama(**kwargs)
        self.n_vocab = self.saver.n_vocab()

    def close(self) -> None:
        for llm in (self.saver, self.restorer):
            llm.close()

    def _clear(self, llm: Any) -> None:
        llm._ctx.kv_cache_clear()
        llm.n_tokens = 0

    def _first_token(self, llm: Any) -> int:
        import numpy as np

        pointer = self.lib.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).argmax())

    def prefill(self, tokens: list[int]) -> float:
        self._clear(self.saver)
        started = time.perf_counter()
        self.saver.eval(tokens)
        return time.perf_counter() - started

    def get_data(self) -> tuple[Any, int, float]:
        """The sequence's state in memory (``llama_state_seq_get_data``): buffer, bytes, seconds."""
        ctx = self.saver._ctx.ctx
        started = time.perf_counter()
        size = self.lib.llama_state_seq_get_size(ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(ctx, buffer, size, 0)
        elapsed = time.perf_counter() - started
        if written != size:
            raise ConfigError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return buffer, size, elapsed

    def save_file(self, path: Path, tokens: list[int]) -> tuple[int, float]:
        """The sequence's state file, fsynced (durable, as a kvstrata checkpoint is): bytes, seconds."""
        array = (self.lib.llama_token * len(tokens))(*tokens)
        started = time.perf_counter()
        written = self.lib.llama_state_seq_save_file(
            self.saver._ctx.ctx, str(path).encode(), 0, array, len(tokens)
        )
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - started
        if not written:
            raise ConfigError(f"llama_state_seq_save_file failed for {path}")
        return path.stat().st_size, elapsed

    def _continue(self, history: list[int], new_token: int) -> int:
        llm = self.restorer
        llm.n_tokens = len(history)
        llm.input_ids[: len(history)] = history
        llm.eval([new_token])
        return self._first_token(llm)

    def restore_memory(
        self, buffer: Any, size: int, history: list[int], new_token: int
    ) -> tuple[float, float, int]:
        """``llama_state_seq_set_data`` + the new token's forward: (restore s, forward s, token)."""
        self._clear(self.restorer)
        started = time.perf_counter()
        read = self.lib.llama_state_seq_set_data(self.restorer._ctx.ctx, buffer, size, 0)
        restored = time.perf_counter()
        if read != size:
            raise ConfigError(f"llama_state_seq_set_data read {read} of {size} bytes")
        token = self._continue(history, new_token)
        return restored - started, time.perf_counter() - restored, token

    def restore_file(self, path: Path, history: list[int], new_token: int) -> tuple[float, float, int]:
        """``llama_state_seq_load_file`` of the state file, dropped from the page cache, + the new
        token's forward: (restore s, forward s, token)."""
        self._clear(self.restorer)
        drop_page_cache([path])
        capacity = len(history) + 1
        tokens_out = (self.lib.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        started = time.perf_counter()
        read = self.lib.llama_state_seq_load_file(
            self.restorer._ctx.ctx, str(path).encode(), 0, tokens_out, capacity, ctypes.byref(count)
        )
        restored = time.perf_counter()
        if not read or count.value != len(history) or list(tokens_out[: count.value]) != history:
            raise ConfigError(f"llama_state_seq_load_file did not give back the {len(history)} tokens")
        token = self._continue(history, new_token)
        return restored - started, time.perf_counter() - restored, token

    def recompute(self, tokens: list[int]) -> tuple[float, int]:
        """Prefill every token in the cleared restorer: (seconds, first token)."""
        self._clear(self.restorer)
        started = time.perf_counter()
        self.restorer.eval(tokens)
        token = self._first_token(self.restorer)
        return time.perf_counter() - started, token
