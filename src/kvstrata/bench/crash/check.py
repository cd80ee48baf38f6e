"""What a crash state must satisfy, checked by opening it as the next process would.

Against the markers before the crash point (what callers were told):

- the store opens (or, refused with one line, ``fsck --rebuild`` brings it back and it opens);
- no wrong KV is ever served: every block a session loads is bit for bit the KV of its tokens, and
  every session is at a version the run committed, with that version's token ids;
- ``"strict"``: every checkpoint that returned is there (that version or a later one), whole, and
  every deletion that returned holds;
- ``"fast"``: the same for what returned before the index's last sync (the documented bound);
  later checkpoints may be rolled back, to an earlier whole version;
- gc on the recovered store deletes nothing a session needs (the sessions read back the same);
- ``fsck --rebuild`` (on some states) restores every checkpoint that returned, in both modes: the
  journal is synced before a commit returns.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstrata.bench.crash.workload import LAYOUT, MODEL, expected_kv, store_config
from kvstrata.config import GcConfig
from kvstrata.errors import KVStrataError


@dataclass(frozen=True, slots=True)
class Told:
    """What the run's callers had been told by some point: the last checkpoint of each session
    that returned, the deletions that returned."""

    checkpoints: dict[str, int]
    deleted: frozenset[str]
    deleting: frozenset[str] = frozenset()
    """Deletions called (returned or not): a session may be gone once its deletion began."""

    @classmethod
    def from_markers(cls, markers: list[tuple[int, str]], before: int) -> Told:
        checkpoints: dict[str, int] = {}
        deleted: set[str] = set()
        deleting: set[str] = set()
        for index, text in markers:
            if index >= before:
                break
            event = json.loads(text)
            if event["event"] == "checkpoint":
                checkpoints[event["id"]] = event["version"]
            elif event["event"] == "deleted":
                deleted.add(event["id"])
            elif event["event"] == "deleting":
                deleting.add(event["id"])
        return cls(checkpoints, frozenset(deleted), frozenset(deleting))


def history(markers: list[tuple[int, str]]) -> dict[str, dict[int, list[int]]]:
    """Every (session, version) the run committed, with its token ids."""
    out: dict[str, dict[int, list[int]]] = {}
    for _, text in markers:
        event = json.loads(text)
        if event["event"] == "checkpoint":
            out.setdefault(event["id"], {})[event["version"]] = event["tokens"]
    return out


@dataclass(slots=True)
class Verdict:
    problems: list[str] = field(default_factory=list)
    rebuilt: bool = False
    """The store did not open; ``fsck --rebuild`` made it open."""
    lost_checkpoints: int = 0
    """Checkpoints that returned and are not there (sessions rolled back to an earlier version);
    always within the bound, or a problem says otherwise."""
    rolled_back_sessions: int = 0


def _sessions(root: Path, mode: str) -> dict[str, tuple[int, list[int], bool]]:
    """Every session of the store at ``root``: (version, token ids, whole), each one's KV checked
    (a wrong block raises)."""
    from kvstrata.store import KVStore

    found = {}
    with KVStore(root, LAYOUT, model_fingerprint=MODEL, config=store_config(mode)) as store:
        for info in store.list_sessions():
            session = store.session(info.id, info.namespace)
            loaded = store.load(session)
            if loaded.kv is not None and not torch.equal(
                loaded.kv, expected_kv(session.token_ids[: loaded.num_tokens])
            ):
                raise AssertionError(f"wrong KV served for session {info.id} v{session.version}")
            whole = loaded.missing_from_token is None and loaded.num_tokens == session.num_tokens
            found[info.id] = (session.version, list(session.token_ids), whole)
    return found


def _open_or_rebuild(
    root: Path, mode: str, verdict: Verdict
) -> dict[str, tuple[int, list[int], bool]] | None:
    from kvstrata.store.recovery.rebuild import rebuild_index

    try:
        return _sessions(root, mode)
    except KVStrataError as first:
        try:
            rebuild_index(root, None)
            verdict.rebuilt = True
            return _sessions(root, mode)
        except (KVStrataError, sqlite3.Error, OSError) as exc:
            verdict.problems.append(f"the store does not open ({first}) and fsck --rebuild fails: {exc}")
    except (sqlite3.Error, OSError, ValueError) as exc:
        verdict.problems.append(f"opening raised {type(exc).__name__}: {exc}")
    except AssertionError as exc:
        verdict.problems.append(str(exc))
    return None


def check_state(
    root: Path,
    mode: str,
    committed: dict[str, dict[int, list[int]]],
    told: Told,
    bound: Told,
    *,
    rebuild: bool = False,
) -> Verdict:
    """Check the state at ``root`` (changed: it is opened, recovered, gc'd); ``told``: what
    returned before the crash; ``bound``: what the mode promises to keep (all of ``told`` in
    strict mode)."""
    verdict = Verdict()
    found = _open_or_rebuild(root, mode, verdict)
    if found is None:
        return verdict
    _compare(found, committed, told, bound, verdict, "")
    if verdict.problems:
        return verdict
    _after_gc(root, mode, found, verdict)
    if rebuild and not verdict.problems:
        _after_rebuild(root, mode, committed, told, verdict)
    return verdict


def _compare(
    found: dict[str, tuple[int, list[int], bool]],
    committed: dict[str, dict[int, list[int]]],
    told: Told,
    bound: Told,
    verdict: Verdict,
    when: str,
) -> None:
    for sid, (version, tokens, whole) in found.items():
        if committed.get(sid, {}).get(version) != tokens:
            verdict.problems.append(f"{when}session {sid} v{version} holds token ids the run never committed")
        elif not whole:
            verdict.problems.append(f"{when}session {sid} v{version} lost blocks")
        if sid in bound.deleted:
            verdict.problems.append(f"{when}session {sid} is back after its deletion returned")
    for sid, version in bound.checkpoints.items():
        if sid in told.deleting and sid not in found:
            continue  # its deletion began before the crash
        if sid not in bound.deleted and (sid not in found or found[sid][0] < version):
            has = "is gone" if sid not in found else f"is at v{found[sid][0]}"
            verdict.problems.append(f"{when}session {sid}: checkpoint v{version} returned, the session {has}")
    for sid, version in told.checkpoints.items():
        if sid not in told.deleted and sid in found and found[sid][0] < version:
            verdict.rolled_back_sessions += 1
            verdict.lost_checkpoints += version - found[sid][0]


def _after_gc(
    root: Path, mode: str, before: dict[str, tuple[int, list[int], bool]], verdict: Verdict
) -> None:
    """gc as eager as it goes, then every session must read back the same (or gc refused)."""
    from kvstrata.store import KVStore

    try:
        # refused (KVStrataError): the index may be behind the journal; nothing was deleted
        config = GcConfig(grace_s=0.0, unreferenced_after_s=0.0, retention_s=1e12)
        with (
            KVStore(root, LAYOUT, model_fingerprint=MODEL, config=store_config(mode)) as store,
            contextlib.suppress(KVStrataError),
        ):
            store.maintenance.collect_garbage(config)
        after = _sessions(root, mode)
    except (KVStrataError, sqlite3.Error, OSError, AssertionError) as exc:
        verdict.problems.append(f"after gc: {exc}")
        return
    if after != before:
        changed = sorted(sid for sid in set(before) | set(after) if before.get(sid) != after.get(sid))
        verdict.problems.append(f"gc changed what sessions read back: {changed}")


def _after_rebuild(
    root: Path, mode: str, committed: dict[str, dict[int, list[int]]], told: Told, verdict: Verdict
) -> None:
    """``fsck --rebuild`` on the state (after gc): every checkpoint that returned comes back."""
    from kvstrata.store.recovery.rebuild import rebuild_index

    copy = root.with_name(root.name + "-rebuilt")
    shutil.copytree(root, copy)
    try:
        rebuild_index(copy, None)
        found = _sessions(copy, mode)
    except (KVStrataError, sqlite3.Error, OSError, AssertionError) as exc:
        verdict.problems.append(f"fsck --rebuild: {exc}")
        return
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    lost = Verdict()
    _compare(found, committed, told, told, lost, "after fsck --rebuild: ")
    verdict.problems += lost.problems
