"""Where a store's cold tier lies: ``cold/`` under the store, or a directory of its own on another
file system (``StoreConfig.cold_dir``, a cheaper disk).

A store given a cold directory records it in a file of its own (``STORE/cold-dir``: not in the
index, so that ``kvstrata fsck --rebuild`` finds the cold blocks too), so every later open
(``kvstrata gc``, ``inspect``, another process) finds its cold blocks without being told,
and claims the directory with a marker file naming the store, so that two stores never share one
(each one's gc would take the other's files for orphans). Blocks move there by copy, fsync, index
commit, then removal of the source (:meth:`~.tier.DiskTier.set_cold`): a rename cannot cross file
systems, and a ``kill -9`` at any step leaves either the old copy named by the index (the new one
an orphan gc removes) or the new one (the old one an orphan, or a hole compaction gives back).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from kvstrata.config import check_cold_dir
from kvstrata.errors import ConfigError
from kvstrata.store.tiers.disk.fileio import fsync_dir

POINTER = "cold-dir"
"""The file under a store's root naming its cold directory (absent: ``cold/`` under the root)."""
MARKER = ".kvstrata-cold"
"""The file in a cold directory naming the store (its root's absolute path) that owns it."""


def recorded_cold_dir(root: Path) -> Path | None:
    """The cold directory the store at ``root`` recorded (None: ``cold/`` under it)."""
    try:
        text = (root / POINTER).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"the store at {root}: cannot read {POINTER}: {exc}") from None
    return Path(text) if text else None


def resolve_cold_dir(root: Path, configured: str | None, *, read_only: bool = False) -> Path | None:
    """The cold directory of the store at ``root`` (None: ``cold/`` under it). ``configured``: the
    one asked for (None: the one the store recorded, if any). A ConfigError, one line, when the
    directory is missing or not writable, belongs to another store, differs from the one the store
    recorded, or the store already keeps cold blocks under ``cold/``."""
    found = recorded_cold_dir(root)
    recorded = str(found) if found is not None else None
    if configured is None:
        if not recorded:
            return None
        try:
            check_cold_dir(recorded)
        except ConfigError as exc:
            raise ConfigError(f"the store at {root} keeps its cold tier in {recorded}: {exc}") from None
        return Path(recorded)
    path = Path(configured).resolve()
    check_cold_dir(str(path))
    if recorded and Path(recorded) != path:
        raise ConfigError(
            f"the store at {root} keeps its cold tier in {recorded}, not {path}: open it with that "
            "cold_dir (or none)"
        )
    owner = str(root.resolve())
    marker = path / MARKER
    try:
        claimed = marker.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        claimed = None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cold_dir {path}: cannot read its marker {MARKER}: {exc}") from None
    if claimed is not None and claimed != owner:
        raise ConfigError(f"cold_dir {path} belongs to the store at {claimed}; give each store its own")
    if recorded or read_only:
        return path
    if claimed is None:
        if any(_block_files(root / "cold")):
            raise ConfigError(
                f"the store at {root} keeps cold blocks under {root / 'cold'}; a cold_dir can only be "
                "given to a store that has none yet"
            )
        if any(entry.name != MARKER for entry in os.scandir(path)):
            raise ConfigError(f"cold_dir {path} is not empty; give the cold tier a directory of its own")
        _write_durably(marker, owner)
    _write_durably(root / POINTER, str(path))
    return path


def _write_durably(final: Path, text: str) -> None:
    temp = final.with_name(final.name + ".tmp")
    temp.write_text(text + "\n", encoding="utf-8")
    fd = os.open(temp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, final)
    fsync_dir(final.parent)


def _block_files(cold: Path) -> Iterator[str]:
    if cold.is_dir():
        for shard in os.scandir(cold):
            if shard.is_dir():
                yield from os.listdir(shard.path)
