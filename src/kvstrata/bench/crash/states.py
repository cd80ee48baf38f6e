"""The on-disk states a crash could leave, built from a recorded run (ALICE / CrashMonkey style).

A run's calls are replayed once to learn which file (inode) each one touched: a name may be
renamed over, unlinked and made again, so a write is tied to the file its descriptor had open,
not to a name. Each call becomes an *event* of one of two kinds: a data event (a write, a
truncation, a preallocation) changes one file's bytes; a name event (a file or directory made, a
rename, an unlink) changes one directory. An ``fsync`` or ``fdatasync`` of a file makes its data
events before the call durable once it returns; of a directory, its name events (a rename, its
source's or target's directory). Nothing else is assumed durable, not even a new file's name
after an fsync of the file (POSIX promises no more; ext4 often gives more).

A crash after the first ``k`` events leaves every durable event, and any subset of the others:
:meth:`Replay.state` takes which, optionally tearing a write (only some of its 512-byte sectors
reach the disk) or applying the chosen writes in another order. ``-shm`` files (SQLite's shared
memory, rebuilt from the WAL by the next open) are left out.
"""

from __future__ import annotations

import bisect
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.bench.crash.recorder import Call, Op

SECTOR = 512
_O_CREAT, _O_TRUNC = os.O_CREAT, os.O_TRUNC


@dataclass(frozen=True, slots=True)
class Event:
    """One recorded change (or marker) of the run, in order."""

    kind: str
    """``write``, ``trunc``, ``extend``, ``create``, ``rename``, ``unlink``, ``mark``, ``sync``."""
    inode: int = -1
    offset: int = 0
    data: bytes = b""
    size: int = 0
    names: tuple[tuple[int, str], ...] = ()
    """Name events: (directory inode, name) pairs: the name made or removed; a rename's source
    then its target."""
    is_dir: bool = False
    text: str = ""


@dataclass(slots=True)
class Replay:
    """A recorded run as events, with when each one becomes durable."""

    events: list[Event] = field(default_factory=list)
    durable_at: list[int] = field(default_factory=list)
    """Per event: the number of events after which it is durable (a sync of its file or
    directory has returned); ``len(events) + 1`` when never."""
    syncs: list[tuple[int, int, int]] = field(default_factory=list)
    """(inode, event index where the sync began, where it returned) of every completed sync."""
    paths: dict[int, str] = field(default_factory=dict)
    """The last name of each inode (for telling the index's files apart)."""
    created: dict[int, int] = field(default_factory=dict)
    """The event that made each inode (its first name)."""

    # -- building -----------------------------------------------------------------------------------
    @classmethod
    def from_calls(cls, calls: Sequence[Call], root: Path) -> Replay:
        replay = cls()
        builder = _Builder(replay, str(root).rstrip("/"))
        for call in calls:
            builder.add(call)
        replay._durability(builder.sync_all)
        return replay

    def _durability(self, sync_all: list[tuple[int, int]]) -> None:
        never = len(self.events) + 1
        by_inode: dict[int, list[tuple[int, int]]] = {}
        for inode, begin, end in self.syncs:
            by_inode.setdefault(inode, []).append((begin, end))
        for inode in list(by_inode):
            by_inode[inode] = sorted(by_inode[inode] + sync_all)
        suffix_min: dict[int, tuple[list[int], list[int]]] = {}
        for inode, spans in by_inode.items():
            begins = [b for b, _ in spans]
            mins = [0] * len(spans)
            low = never
            for i in range(len(spans) - 1, -1, -1):
                low = min(low, spans[i][1])
                mins[i] = low
            suffix_min[inode] = (begins, mins)
        all_begins = [b for b, _ in sorted(sync_all)]
        all_mins = _suffix_min([e for _, e in sorted(sync_all)], never)

        def first_sync(inode: int, index: int) -> int:
            begins, mins = suffix_min.get(inode, (all_begins, all_mins))
            at = bisect.bisect_right(begins, index)
            return mins[at] if at < len(mins) else never

        for index, event in enumerate(self.events):
            if event.kind in ("write", "trunc", "extend"):
                self.durable_at.append(first_sync(event.inode, index))
            elif event.kind in ("create", "unlink", "rename"):
                self.durable_at.append(min(first_sync(d, index) for d, _ in event.names))
            else:
                self.durable_at.append(index + 1)  # markers, syncs: nothing to lose

    # -- crash states ---------------------------------------------------------------------------------
    def created_durable(self, inode: int, k: int) -> bool:
        """Whether the name ``inode`` was made with is durable after ``k`` events."""
        at = self.created.get(inode)
        return at is not None and self.durable_at[at] <= k

    def sync_points(self) -> list[int]:
        """Every crash point right after a sync returned."""
        return sorted({end + 1 for _, _, end in self.syncs})

    def markers(self, k: int) -> list[tuple[int, str]]:
        return [(i, e.text) for i, e in enumerate(self.events[:k]) if e.kind == "mark"]

    def state(
        self,
        k: int,
        target: Path,
        *,
        keep: float = 0.0,
        rng: random.Random | None = None,
        tear: bool = False,
        reorder: bool = False,
    ) -> int:
        """Write the files a crash after ``k`` events leaves into ``target`` (an empty directory):
        every durable event, and each other one with probability ``keep`` (1.0: a process crash,
        the page cache intact). ``tear``: a write that is kept may reach the disk only in part
        (each of its sectors on its own); ``reorder``: the kept writes that are not durable land in
        a shuffled order. How many events that were not durable were kept."""
        rng = rng or random.Random(k)
        chosen: list[int] = []
        late: list[int] = []
        for i in range(k):
            if self.durable_at[i] <= k:
                chosen.append(i)
            elif keep >= 1.0 or (keep > 0.0 and rng.random() < keep):
                (late if reorder and self.events[i].kind == "write" else chosen).append(i)
        rng.shuffle(late)
        files: dict[int, bytearray] = {}
        names: dict[tuple[int, str], int] = {}
        dirs = {0}
        kept = 0
        for i in [*chosen, *late]:
            event = self.events[i]
            durable = self.durable_at[i] <= k
            kept += not durable
            _apply(event, files, names, dirs, tear=tear and not durable, rng=rng)
        _materialize(files, names, dirs, target)
        return kept


def _suffix_min(values: list[int], never: int) -> list[int]:
    out = [0] * len(values)
    low = never
    for i in range(len(values) - 1, -1, -1):
        low = min(low, values[i])
        out[i] = low
    return out


def _apply(
    event: Event,
    files: dict[int, bytearray],
    names: dict[tuple[int, str], int],
    dirs: set[int],
    *,
    tear: bool,
    rng: random.Random,
) -> None:
    kind = event.kind
    if kind == "write":
        buf = files.setdefault(event.inode, bytearray())
        pieces = [(event.offset, event.data)]
        if tear and len(event.data) > 0:
            pieces = _torn(event.offset, event.data, rng)
        for offset, data in pieces:
            end = offset + len(data)
            if len(buf) < end:
                buf.extend(bytes(end - len(buf)))
            buf[offset:end] = data
    elif kind == "trunc":
        buf = files.setdefault(event.inode, bytearray())
        if len(buf) > event.size:
            del buf[event.size :]
        else:
            buf.extend(bytes(event.size - len(buf)))
    elif kind == "extend":
        buf = files.setdefault(event.inode, bytearray())
        if len(buf) < event.size:
            buf.extend(bytes(event.size - len(buf)))
    elif kind == "create":
        names[event.names[0]] = event.inode
        if event.is_dir:
            dirs.add(event.inode)
        else:
            files.setdefault(event.inode, bytearray())
    elif kind == "rename":
        source, target = event.names
        if names.get(source) == event.inode:
            del names[source]
        names[target] = event.inode
    elif kind == "unlink" and names.get(event.names[0]) == event.inode:
        del names[event.names[0]]


def _torn(offset: int, data: bytes, rng: random.Random) -> list[tuple[int, bytes]]:
    """The sectors of a write that reached the disk: each one, or not, on its own."""
    pieces = []
    start = offset
    while start < offset + len(data):
        end = min(offset + len(data), (start // SECTOR + 1) * SECTOR)
        if rng.random() < 0.5:
            pieces.append((start, data[start - offset : end - offset]))
        start = end
    return pieces


def _materialize(
    files: dict[int, bytearray], names: dict[tuple[int, str], int], dirs: set[int], target: Path
) -> None:
    children: dict[int, list[tuple[str, int]]] = {}
    for (parent, name), inode in names.items():
        children.setdefault(parent, []).append((name, inode))
    stack = [(0, target)]
    while stack:
        inode, path = stack.pop()
        for name, child in children.get(inode, []):
            if child in dirs:
                (path / name).mkdir()
                stack.append((child, path / name))
            elif not name.endswith("-shm"):
                (path / name).write_bytes(files.get(child, b""))


class _Builder:
    """The volatile replay: which inode each call touched."""

    def __init__(self, replay: Replay, root: str) -> None:
        self.replay = replay
        self.root = root
        self.inodes: dict[str, int] = {"": 0}
        self.is_dir: dict[int, bool] = {0: True}
        self.fds: dict[tuple[int, int], int] = {}
        self.open_syncs: dict[tuple[int, int], int] = {}
        self.sync_all: list[tuple[int, int]] = []
        self._sync_all_begin: int | None = None
        self.next_inode = 1

    def _rel(self, path: str) -> str:
        if path == self.root:
            return ""
        if not path.startswith(self.root + "/"):
            raise ValueError(f"{path} is outside the recorded directory {self.root}")
        return os.path.normpath(path[len(self.root) + 1 :])

    def _name(self, rel: str) -> tuple[int, str]:
        parent, _, name = rel.rpartition("/")
        if parent not in self.inodes:
            raise ValueError(f"{rel}: its directory was never seen being made")
        return self.inodes[parent], name

    def _emit(self, event: Event) -> None:
        self.replay.events.append(event)

    def _new(self, rel: str, is_dir: bool) -> int:
        inode = self.next_inode
        self.next_inode += 1
        self.inodes[rel] = inode
        self.is_dir[inode] = is_dir
        self.replay.paths[inode] = rel
        self.replay.created[inode] = len(self.replay.events)
        self._emit(Event("create", inode, names=(self._name(rel),), is_dir=is_dir))
        return inode

    def add(self, call: Call) -> None:
        op = call.op
        if op == Op.UNSUPPORTED:
            raise ValueError(f"the run made a call the replay cannot model: {call.path} ({call.a})")
        if op == Op.OPEN:
            rel = self._rel(call.path)
            inode = self.inodes.get(rel)
            if inode is None:
                if not call.b & _O_CREAT:
                    raise ValueError(f"{rel} was opened but never seen being made")
                inode = self._new(rel, False)
            elif call.b & _O_TRUNC and not self.is_dir[inode]:
                self._emit(Event("trunc", inode, size=0))
            self.fds[(call.pid, call.a)] = inode
        elif op == Op.CLOSE:
            self.fds.pop((call.pid, call.a), None)
        elif op in (Op.WRITE, Op.TRUNC, Op.FALLOCATE):
            inode = self.fds.get((call.pid, call.a)) if call.a >= 0 else self.inodes.get(self._rel(call.path))
            if inode is None:
                return
            if op == Op.WRITE:
                self._emit(Event("write", inode, offset=call.b, data=call.data))
            elif op == Op.TRUNC:
                self._emit(Event("trunc", inode, size=call.b))
            else:
                self._emit(Event("extend", inode, size=call.b + call.c))
        elif op == Op.FSYNC_BEGIN:
            self.open_syncs[(call.pid, call.a)] = len(self.replay.events)
            self._emit(Event("sync"))
        elif op == Op.FSYNC_END:
            begin = self.open_syncs.pop((call.pid, call.a), None)
            inode = self.fds.get((call.pid, call.a))
            if begin is not None and inode is not None:
                self.replay.syncs.append((inode, begin, len(self.replay.events)))
            self._emit(Event("sync"))
        elif op == Op.SYNC_ALL_BEGIN:
            self._sync_all_begin = len(self.replay.events)
            self._emit(Event("sync"))
        elif op == Op.SYNC_ALL_END:
            if self._sync_all_begin is not None:
                self.sync_all.append((self._sync_all_begin, len(self.replay.events)))
            self._emit(Event("sync"))
        elif op == Op.MKDIR:
            self._new(self._rel(call.path), True)
        elif op in (Op.UNLINK, Op.RMDIR):
            rel = self._rel(call.path)
            inode = self.inodes.pop(rel, None)
            if inode is not None:
                self._emit(Event("unlink", inode, names=(self._name(rel),)))
        elif op == Op.RENAME:
            source, target = self._rel(call.path), self._rel(call.path2)
            inode = self.inodes.pop(source, None)
            if inode is None or self.is_dir[inode]:
                raise ValueError(f"rename of {source}: not a file the run made")
            self.inodes[target] = inode
            self.replay.paths[inode] = target
            self._emit(Event("rename", inode, names=(self._name(source), self._name(target))))
        elif op == Op.MARK:
            self._emit(Event("mark", text=call.data.decode()))
