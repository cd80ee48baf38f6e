"""Session archives: a round trip restores the session exactly; any damage is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from server_builders import open_store, tiny_model

from kvstrata.engine import Engine
from kvstrata.errors import CorruptBlockError, SessionExistsError
from kvstrata.integrations.transformers.model import LoadedModel
from kvstrata.store import KVStore, archive

MESSAGES = [{"role": "user", "content": "Write down everything about the archive format, please."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def exported(
    model: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> tuple[bytes, list[int], torch.Tensor]:
    with open_store(model, tmp_path_factory.mktemp("src")) as store:
        Engine(model, store).chat("s", MESSAGES, max_new_tokens=5)
        session = store.session("s")
        assert session.tail_key is not None  # the archive holds a partial block too
        return store.archives.export_session(session), list(session.token_ids), store.load(session).kv


def blocks_on_disk(store: KVStore) -> int:
    return store.disk.usage().blocks


def test_import_restores_tokens_and_kv(model: LoadedModel, exported: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    data, tokens, kv = exported
    parsed = archive.read_archive(data)
    header, blocks = parsed.header, parsed.blocks
    assert (header.session_id, header.namespace, header.num_tokens) == ("s", "default", len(tokens))
    with open_store(model, tmp_path) as store:
        session = store.archives.import_session(data)
        assert session.token_ids == tokens
        assert len(session.all_keys()) == len(blocks)
        assert torch.equal(store.load(session).kv, kv)
    with open_store(model, tmp_path) as store:  # committed: survives a reopen
        assert store.session("s").token_ids == tokens


def test_import_into_another_namespace_rekeys_blocks(
    model: LoadedModel,
    exported: tuple,  # type: ignore[type-arg]
    tmp_path: Path,
) -> None:
    data, tokens, kv = exported
    with open_store(model, tmp_path) as store:
        session = store.archives.import_session(data, new_id="copy", namespace="tenant-b")
        assert session.block_keys == store.block_key_chain("tenant-b", tokens)
        assert torch.equal(store.load(session).kv, kv)
        with pytest.raises(SessionExistsError):
            store.archives.import_session(data, new_id="copy", namespace="tenant-b")


@pytest.mark.parametrize("where", [0, 9, 40, 0.3, 0.5, 0.8, -5, -1])
def test_any_damaged_byte_is_refused_and_nothing_written(
    model: LoadedModel,
    exported: tuple,  # type: ignore[type-arg]
    tmp_path: Path,
    where: float,
) -> None:
    data = bytearray(exported[0])
    pos = int(where * len(data)) if isinstance(where, float) else where
    data[pos] ^= 0x40
    with open_store(model, tmp_path) as store:
        with pytest.raises(CorruptBlockError):
            store.archives.import_session(bytes(data))
        assert store.list_sessions() == [] and blocks_on_disk(store) == 0


def test_truncated_archive_is_refused(model: LoadedModel, exported: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    with open_store(model, tmp_path) as store:
        for size in (0, 10, len(exported[0]) // 2, len(exported[0]) - 1):
            with pytest.raises(CorruptBlockError):
                store.archives.import_session(exported[0][:size])
        assert store.list_sessions() == []
