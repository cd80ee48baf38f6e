"""Store roots: what ``--store DIR`` (and the vLLM connector's ``store_dir``) means: a directory
holding one store per model layout.

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

from pathlib import Path

from kvstrata.config import default_store_dir
from kvstrata.errors import ConfigError
from kvstrata.layout import KVLayout

INDEX_FILE = "index.sqlite"
LAYOUT_DIR_CHARS = 12


def store_root(store: Path | None) -> Path:
    return (store or default_store_dir()).expanduser()


def is_store(path: Path) -> bool:
    return (path / INDEX_FILE).is_file()


def layout_dir_name(layout: KVLayout) -> str:
    return layout.fingerprint.hex()[:LAYOUT_DIR_CHARS]


def store_for_layout(root: Path, layout: KVLayout) -> Path:
    """Where a model of ``layout`` keeps its store under ``root``."""
    return root if is_store(root) else root / layout_dir_name(layout)


def find_stores(root: Path) -> list[Path]:
    """The stores under ``root``: ``root`` itself if it is one, else its subdirectories that are."""
    if is_store(root):
        return [root]
    if not root.is_dir():
        return []
    try:
        return sorted(child for child in root.iterdir() if child.is_dir() and is_store(child))
    except OSError as exc:
        raise ConfigError(f"cannot read the store directory {root}: {exc.strerror or exc}") from exc
