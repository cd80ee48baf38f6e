"""Recording a process's file operations under one directory: the ``recorder.c`` shim, built on
first use, loaded with ``LD_PRELOAD`` into the process, and its log read back as operations.

Python-level patching would miss SQLite's own writes and fsyncs and the native and ``O_DIRECT``
writes of the store; every one of them goes through the C library's calls, which the shim wraps.
``strace`` would see them too but is not always installed, and would have to dump every byte
written through a pipe; the shim writes them straight into its log.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from kvstrata.native.library import cache_dir

SOURCE = Path(__file__).with_name("recorder.c")
_HEAD = struct.Struct("<IBIqqqHH")


class Op(IntEnum):
    OPEN = 1
    CLOSE = 2
    WRITE = 3
    TRUNC = 4
    FSYNC_BEGIN = 5
    FSYNC_END = 6
    RENAME = 7
    UNLINK = 8
    MKDIR = 9
    RMDIR = 10
    MARK = 11
    UNSUPPORTED = 12
    FALLOCATE = 13
    SYNC_ALL_BEGIN = 14
    SYNC_ALL_END = 15


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded call: ``a``, ``b``, ``c`` as the shim filled them (fd, offset or flags, length)."""

    op: Op
    pid: int
    a: int
    b: int
    c: int
    path: str
    path2: str
    data: bytes


def unavailable() -> str | None:
    """Why the recorder cannot run here (None: it can)."""
    if os.name != "posix" or not Path("/proc/self/fd").is_dir():
        return "needs Linux (LD_PRELOAD and /proc)"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return "no C compiler to build the recorder"
    return None


def build() -> Path:
    """The shim, compiled once per machine into the native cache (named by its source's hash)."""
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256(SOURCE.read_bytes() + compiler.encode()).hexdigest()[:16]
    target = cache_dir() / f"crash-recorder-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-ldl", "-lpthread"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def recording_env(shim: Path, root: Path, log: Path, marks: Path) -> dict[str, str]:
    """The environment of a process to record: what it does under ``root`` goes to ``log``, what
    it writes to ``marks`` becomes markers in the same log."""
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=str(shim),
        KVS_TRACE_ROOT=str(root),
        KVS_TRACE_LOG=str(log),
        KVS_TRACE_MARK=str(marks),
    )
    return env


def read_log(path: Path, pid: int | None = None) -> list[Call]:
    """The calls of a log, in the order they were recorded (those of process ``pid`` only, when
    given: a child it started, a compiler say, is not part of the workload)."""
    data = path.read_bytes()
    calls: list[Call] = []
    at = 0
    while at + _HEAD.size <= len(data):
        rest, op, who, a, b, c, l1, l2 = _HEAD.unpack_from(data, at)
        end = at + 4 + rest
        if end > len(data):
            break  # the recorded process was killed in the middle of a record
        body = at + _HEAD.size
        p1 = data[body : body + l1].decode("utf-8", "surrogateescape")
        p2 = data[body + l1 : body + l1 + l2].decode("utf-8", "surrogateescape")
        if pid is None or who == pid:
            calls.append(Call(Op(op), who, a, b, c, p1, p2, data[body + l1 + l2 : end]))
        at = end
    return calls
