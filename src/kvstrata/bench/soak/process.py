"""The soak's ``kvstrata serve``: a child process it starts, stops (SIGTERM), kills (``kill -9``)
and starts again on the same store; and what it reads of it and of the store from outside
(``/proc``, the files' allocated blocks, the page cache's resident pages)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.bench.common.servers import free_port
from kvstrata.errors import ConfigError

INDEX_SUFFIXES = (".sqlite", ".sqlite-wal", ".sqlite-shm", ".sqlite-journal", ".db", ".db-wal", ".db-shm")
DATA_SUFFIXES = (".kvseg", ".kvbin")


@dataclass
class ServeProcess:
    """``kvstrata serve --model MODEL --store STORE`` on a fixed loopback port (kept across
    restarts, so that clients keep their URL)."""

    model: Path | str | None
    """None: the server's default model."""
    store: Path
    env: dict[str, str]
    extra_args: list[str]
    log_dir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout_s: float = 300.0) -> float:
        """Start it and wait for /healthz; the seconds that took."""
        import httpx

        args = [sys.executable, "-m", "kvstrata.cli.main", "serve"]
        args += ["--model", str(self.model)] if self.model is not None else []
        args += ["--store", str(self.store), "--port", str(self.port), *self.extra_args]
        log_path = self.log_dir / f"serve-{self.starts}.log"
        started = time.monotonic()
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.starts += 1
        while True:
            if self.process.poll() is not None:
                raise ConfigError(f"kvstrata serve exited ({self.process.returncode}): {_tail(log_path)}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if time.monotonic() - started > timeout_s:
                raise ConfigError(f"kvstrata serve did not start in {timeout_s:.0f} s: {_tail(log_path)}")
            time.sleep(0.1)

    def stop(self, *, kill: bool = False, timeout_s: float = 120.0) -> int | None:
        """SIGTERM (drains, flushes, closes the store) or SIGKILL; the exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:]


# -- what is read from outside -------------------------------------------------------------------


def process_figures(pid: int) -> tuple[int, int, int]:
    """(resident bytes, open file descriptors, threads) of process ``pid``, from /proc."""
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd")), threads


def store_files(store: Path) -> tuple[list[Path], list[Path]]:
    """(data files: segments and block files, index files) under a store root."""
    data, index = [], []
    for path in store.rglob("*"):
        if path.is_file():
            if path.name.endswith(DATA_SUFFIXES):
                data.append(path)
            elif path.name.endswith(INDEX_SUFFIXES):
                index.append(path)
    return data, index


def allocated_bytes(paths: list[Path]) -> tuple[int, int]:
    """(bytes allocated on disk, apparent sizes) of ``paths`` (files gone meanwhile: 0)."""
    allocated = apparent = 0
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        allocated += st.st_blocks * 512
        apparent += st.st_size
    return allocated, apparent


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of ``paths`` resident in the page cache (``mincore`` over a read-only mapping)."""
    page = mmap.PAGESIZE
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, _MAP_FAILED):
                continue
            try:
                pages = (size + page - 1) // page
                vector = (ctypes.c_ubyte * pages)()
                if _libc.mincore(address, size, vector) == 0:
                    total += sum(1 for v in vector if v & 1) * page
            finally:
                _libc.munmap(address, size)
        finally:
            os.close(fd)
    return total
