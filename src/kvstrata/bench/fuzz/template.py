"""The stores the fuzzer damages: built once per run through the public API, with what a healthy
store serves recorded as the reference each damaged copy is held to.

Two templates, one in the clear and one encrypted, each with sessions of every priority class
(exact records read in place, int8 and 4-bit records decoded), a shared prefix (dedup), a fork,
session documents, blocks aged into files of their own in ``cold/`` and blocks in ``segments/``.
The reference is what the pristine store serves: each session's token ids, the KV of its blocks
(bit for bit, lossy codecs included) and its documents.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.config import GcConfig, StoreConfig
from kvstrata.layout import KVLayout
from kvstrata.priority import Priority
from kvstrata.store import KVStore

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)
MODEL = b"fuzz-model"
KEY = bytes(range(32))
DOCUMENT = "chat"


def session_kv(token_ids: list[int], start: int = 0) -> torch.Tensor:
    """KV that is a pure function of (token, position), as a real prefix's is."""
    tok = torch.tensor(token_ids, dtype=torch.float32).view(1, 1, 1, -1, 1)
    pos = torch.arange(start, start + len(token_ids), dtype=torch.float32).view(1, 1, 1, -1, 1)
    dims = torch.arange(LAYOUT.head_dim, dtype=torch.float32).view(1, 1, 1, 1, -1)
    kv = torch.sin(tok * 0.37 + pos * 0.011 + dims * 0.5) + tok * 1e-3
    return kv.expand(*LAYOUT.block_shape(len(token_ids))).contiguous()


@dataclass(frozen=True, slots=True)
class Expected:
    """What the pristine store serves for one session."""

    token_ids: list[int]
    kv: torch.Tensor
    document: bytes | None


@dataclass(frozen=True, slots=True)
class Template:
    root: Path
    key: bytes | None
    sessions: dict[str, Expected]

    def config(self, *, direct_reads: bool) -> StoreConfig:
        """How a trial opens a copy: no memory tiers (every read is an L3 read) and the path asked."""
        return StoreConfig(
            l1_budget_bytes=0, l2_budget_bytes=0, l3_direct_reads=direct_reads, encryption_key=self.key
        )


_SESSIONS: list[tuple[str, Priority, list[int]]] = [
    ("rt-a", Priority.REALTIME, list(range(100, 137))),
    ("rt-b", Priority.REALTIME, [*range(100, 116), *range(500, 511)]),  # shares 4 blocks with rt-a
    ("ia-a", Priority.INTERACTIVE, list(range(900, 950))),
    ("bg-a", Priority.BACKGROUND, list(range(2000, 2042))),
]


def build(root: Path, key: bytes | None) -> Template:
    """The template store at ``root`` (built afresh) and its reference."""
    shutil.rmtree(root, ignore_errors=True)
    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0, encryption_key=key)
    with KVStore(root, LAYOUT, model_fingerprint=MODEL, config=config) as store:
        for i, (name, priority, tokens) in enumerate(_SESSIONS):
            session = store.create_session(name, priority=priority)
            store.append(session, tokens, session_kv(tokens))
            store.checkpoint(session)
            store.documents.put(name, DOCUMENT, f"transcript of {name}".encode())
            if i == 1:  # the first sessions' blocks move into files of their own in cold/
                store.flush()
                store.maintenance.collect_garbage(GcConfig(cold_after_s=0.0))
        child = store.fork(store.session("rt-a"), "rt-fork")
        more = list(range(3000, 3011))
        store.append(child, more, session_kv(more, child.num_tokens))
        store.checkpoint(child)
        store.flush()
    return Template(root, key, reference(root, key))


def reference(root: Path, key: bytes | None) -> dict[str, Expected]:
    """What the store at ``root`` serves, session by session."""
    out = {}
    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0, encryption_key=key)
    with KVStore(root, model_fingerprint=MODEL, config=config, read_only=True) as store:
        for info in store.list_sessions():
            session = store.session(info.id)
            loaded = store.load(session)
            assert loaded.kv is not None and loaded.num_tokens == session.num_tokens, info.id
            document = store.documents.get(info.id, DOCUMENT)
            out[info.id] = Expected(list(session.token_ids), loaded.kv.clone(), document)
    return out


def copy(template: Template, root: Path) -> Template:
    """A copy of the template's files at ``root`` (the reference is shared)."""
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(template.root, root, ignore=shutil.ignore_patterns("procs", "*.lock"))
    return dataclasses.replace(template, root=root)
