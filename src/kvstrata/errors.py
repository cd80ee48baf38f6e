"""The one exception tree of kvstrata.

Lower-level errors (OSError, sqlite3.Error, zstd errors, ...) are translated at the boundary of
the module that meets them and chained with ``from exc``. A cache miss is never an exception: it
is ``None``. Running out of room in a tier is an explicit return value (see ``tiers.base``).
"""

from __future__ import annotations

from pathlib import Path


class KVStrataError(Exception):
    """Base class of every error kvstrata raises on purpose."""


class ConfigError(KVStrataError, ValueError):
    """A configuration value or an argument is invalid."""


class LayoutMismatchError(KVStrataError):
    """Persisted data was written for another model geometry, dtype or block size."""


class StoreFormatError(KVStrataError):
    """A store directory or index is foreign, from an unknown format version, or unreadable."""


class IndexBehindError(StoreFormatError):
    """The index may not describe every data file (older than them, or rebuilt and not yet
    checked): maintenance that deletes files waits for ``kvstrata fsck``."""


class StoreBusyError(KVStrataError):
    """Another process holds what this one asked for (a session's lease, a maintenance lock)."""


class SessionBusyError(StoreBusyError):
    """Another live process is changing this session right now (it holds the session's lease)."""


class CorruptBlockError(KVStrataError):
    """A block record failed validation (magic, version, length, CRC, key or layout)."""

    def __init__(self, reason: str, path: Path | str | None = None) -> None:
        self.reason = reason
        self.path = Path(path) if path is not None else None
        where = f"{self.path}: " if self.path is not None else ""
        super().__init__(f"{where}{reason}")


class EncryptionKeyError(KVStrataError):
    """A record is encrypted and this store has no key to open it."""


class CodecError(KVStrataError):
    """A codec cannot encode the given block, or its parameters are invalid."""


class TierUnavailableError(KVStrataError):
    """A tier cannot serve requests right now (disk full, remote down, ...)."""


class SessionNotFoundError(KVStrataError, KeyError):
    """No session with that id exists in the namespace."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "session not found"


class SessionConflictError(KVStrataError):
    """Another engine updated the session since this one read it (optimistic versioning)."""


class SessionExistsError(KVStrataError):
    """A session with that id already exists."""
