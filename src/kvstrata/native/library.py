"""One C source compiled into a cached shared library, loaded with ctypes in the background."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import platformdirs

log = logging.getLogger(__name__)

ENV = "KVSTRATA_NATIVE_KERNELS"
"""``0`` turns every native helper off (the pure-torch paths stay)."""
CACHE_ENV = "KVSTRATA_NATIVE_CACHE"
BUILD_TIMEOUT_S = 300.0
T = TypeVar("T")


def cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path(platformdirs.user_cache_dir("kvstrata")) / "native"


class BackgroundBuild(Generic[T]):
    """Something built (or found built) once per process, in a background thread, while the
    caller goes on without it: ``unavailable`` says why it cannot be (None: go ahead), ``make``
    builds it and returns it with its status, or None with the reason."""

    def __init__(
        self,
        label: str,
        unavailable: Callable[[], str | None],
        make: Callable[[], tuple[T | None, str]],
    ) -> None:
        self.label, self._unavailable_reason, self._make = label, unavailable, make
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._result: T | None = None
        self._status = "not built"

    def loaded(self) -> T | None:
        """The built thing once loaded, else None (never blocks)."""
        return self._result

    def ready(self) -> T | None:
        """The built thing once loaded; else None, with its build started in the background (the
        caller takes its fallback path meanwhile)."""
        result = self.loaded()
        if result is None:
            self.start()
        return result

    def status(self) -> str:
        """``loaded``, ``building``, ``not built``, or why it is not used."""
        return self._status

    def start(self) -> None:
        """Build and load in a background thread, once per process (no-op after)."""
        with self._lock:
            if self._thread is not None or self._done.is_set():
                return
            reason = self._unavailable_reason()
            if reason is not None:
                self._finish(None, reason)
                return
            self._status = "building"
            self._thread = threading.Thread(
                target=self._run, name=f"kvstrata-build-{self.label}", daemon=True
            )
            self._thread.start()

    def load(self, timeout: float | None = None) -> T | None:
        """Build and load now, waiting at most ``timeout`` seconds; None if unavailable."""
        self.start()
        self._done.wait(timeout)
        return self._result

    def _run(self) -> None:
        result, status = self._make()
        self._finish(result, status)

    def _finish(self, result: T | None, status: str) -> None:
        self._result, self._status = result, status
        self._done.set()
        log.info("native %s: %s", self.label, status)


class NativeLibrary(BackgroundBuild[ctypes.CDLL]):
    """``source`` (C) built with ``flags`` into ``<cache>/<name>-<hash>.so``; ``setup`` declares
    the functions' ctypes signatures and returns None when the library can serve, else why not
    (for example, the CPU lacks the instructions)."""

    def __init__(
        self,
        name: str,
        source: Path,
        flags: list[str],
        setup: Callable[[ctypes.CDLL], str | None],
    ) -> None:
        super().__init__(name, self._unavailable, self._build)
        self.name, self.source, self.flags, self._setup = name, source, flags, setup

    def _unavailable(self) -> str | None:
        if os.environ.get(ENV, "1") == "0":
            return f"turned off ({ENV}=0)"
        if not self.source.is_file():
            return f"its source is missing ({self.source})"
        if shutil.which(self._compiler()) is None:
            return f"no C compiler ({self._compiler()!r} not found)"
        return None

    @staticmethod
    def _compiler() -> str:
        return os.environ.get("CC", "cc")

    def path(self) -> Path:
        """Where the built library lies: named by a hash of source, flags and compiler."""
        digest = hashlib.sha256()
        digest.update(self.source.read_bytes())
        digest.update(" ".join([self._compiler(), *self.flags]).encode())
        return cache_dir() / f"{self.name}-{digest.hexdigest()[:16]}.so"

    def _build(self) -> tuple[ctypes.CDLL | None, str]:
        try:
            target = self.path()
            if not target.is_file():
                self._compile(target)
            lib = ctypes.CDLL(str(target))
            reason = self._setup(lib)
        except Exception as exc:  # a compiler error, a broken toolchain: the torch path stays
            log.warning("native helper %s could not be built; using torch\n%s", self.name, exc)
            lines = [line for line in str(exc).splitlines() if "error" in line.lower()]
            return None, f"build failed: {(lines or [type(exc).__name__])[0].strip()}"
        return (lib, "loaded") if reason is None else (None, reason)

    def _compile(self, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.close(fd)
        try:
            command = [self._compiler(), *self.flags, "-shared", "-fPIC", "-o", tmp, str(self.source)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
            os.replace(tmp, target)  # atomic: a concurrent build of the same library just wins
        finally:
            Path(tmp).unlink(missing_ok=True)
