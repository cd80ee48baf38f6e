"""What ``--store DIR`` means, for every command: a store root holding one store per model layout
(the paths: :mod:`kvstrata.store.roots`; here what the commands add: one-line failures, read-only
opens, the choice of one store among several).

A store serves one KV layout (layers, KV heads, head dim, dtype, block size), so the commands that
load a model (``chat``, ``serve``, ``demo``) keep its store in ``DIR/<layout>/``, where ``<layout>``
is the first 12 hex digits of the layout's fingerprint. The commands that read or maintain stores
(``sessions``, ``store stats``, ``gc``) look under ``DIR`` for them: with one store there they use
it, with several they list across all of them or ask for ``--layout``. A ``DIR`` that is itself a
store (``DIR/index.sqlite``: a vLLM connector's ``store_dir``, a store made with ``KVStore(DIR)``)
is accepted everywhere and used as it is.

    DIR/
      66623acb331b/   index.sqlite hot/ cold/ segments/ ...   one model layout (e.g. the tiny Llama)
      d81ab0fd5c92/   index.sqlite hot/ cold/ segments/ ...   another (e.g. SmolLM2-135M)
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvstrata.cli.common import fail
from kvstrata.config import StoreConfig, encryption_key_from_env
from kvstrata.errors import KVStrataError
from kvstrata.layout import KVLayout
from kvstrata.store import KVStore, roots
from kvstrata.store.roots import store_for_layout, store_root

__all__ = [
    "StoreRef",
    "check_writable_root",
    "find_stores",
    "one_store",
    "open_store",
    "store_for_layout",
    "store_root",
    "stores_under",
]


def find_stores(root: Path) -> list[Path]:
    """The stores under ``root`` (:func:`kvstrata.store.roots.find_stores`); one line if unreadable."""
    try:
        return roots.find_stores(root)
    except KVStrataError as exc:
        fail(str(exc))


def check_writable_root(root: Path) -> None:
    """Fail with one line, before a model loads for seconds, if no store can be written at ``root``."""
    if root.exists() and not root.is_dir():
        fail(f"cannot use {root} as a store directory: it is a file")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot use {root} as a store directory: {exc.strerror or exc}")
    try:
        # a real write: permission bits, read-only mounts and quotas all show up here
        with tempfile.TemporaryFile(dir=root, prefix=".kvstrata-probe-"):
            pass
    except OSError as exc:
        fail(f"cannot write to the store directory {root}: {exc.strerror or exc}")


@dataclass(frozen=True, slots=True)
class StoreRef:
    """One store found under a root, with its layout (read from its index)."""

    path: Path
    layout: KVLayout

    @property
    def name(self) -> str:
        return self.path.name

    def describe(self) -> str:
        lay = self.layout
        return (
            f"{self.name} ({lay.num_layers} layers, {lay.num_kv_heads} KV heads, head dim "
            f"{lay.head_dim}, {lay.dtype})"
        )


def open_store(path: Path, *, read_only: bool = False, cold_dir: str | None = None) -> KVStore:
    """Open an existing store with its recorded layout and no memory tiers (``cold_dir``: its
    cold tier's directory, when given one now). Read-only opens are safe while another process (a
    server, a demo) owns the store."""
    try:
        config = StoreConfig(
            l1_budget_bytes=0, l2_budget_bytes=0, encryption_key=encryption_key_from_env(), cold_dir=cold_dir
        )
        return KVStore(path, config=config, read_only=read_only)
    except KVStrataError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot open the store at {path}: {exc.strerror or exc}")


def stores_under(store: Path | None, layout: str | None = None) -> list[StoreRef]:
    """The stores ``--store`` (and ``--layout``, a layout directory name or a prefix of it) name;
    fails with one line when there are none."""
    root = store_root(store)
    found = find_stores(root)
    if not found:
        fail(
            f"no kvstrata store at {root} (a store, or a directory of stores, one per model layout; "
            "use --store or KVSTRATA_STORE)"
        )
    refs = []
    for path in found:
        kv = open_store(path, read_only=True)
        try:
            refs.append(StoreRef(path, kv.layout))
        finally:
            kv.close()
    if layout is None:
        return refs
    chosen = [ref for ref in refs if ref.name.startswith(layout)]
    if not chosen:
        fail(f"no store for --layout {layout!r} under {root}; there: {_choices(refs)}")
    if len(chosen) > 1:
        fail(f"--layout {layout!r} matches {len(chosen)} stores under {root}: {_choices(chosen)}")
    return chosen


def one_store(store: Path | None, layout: str | None = None) -> StoreRef:
    """The one store a command acts on; with several under the root, one line asking for --layout."""
    refs = stores_under(store, layout)
    if len(refs) > 1:
        fail(
            f"{store_root(store)} holds {len(refs)} stores, one per model layout: {_choices(refs)}; "
            "choose one with --layout"
        )
    return refs[0]


def _choices(refs: list[StoreRef]) -> str:
    return ", ".join(ref.describe() for ref in refs)
