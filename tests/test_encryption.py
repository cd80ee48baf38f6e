"""Encryption at rest: AES-256-GCM per namespace, for L3 files (and remote values)."""

from __future__ import annotations

import base64
import os
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import crc32c
import pytest
import torch
from typer.testing import CliRunner

from kvstrata import KVStore, StoreConfig
from kvstrata.cli.main import app
from kvstrata.crypto import Keyring, parse_master_key
from kvstrata.errors import ConfigError, CorruptBlockError, EncryptionKeyError
from kvstrata.store.kvbin import decode_record, encode_record
from kvstrata.store.tiers.base import TierLevel
from kvstrata.store.tiers.remote import RemoteConfig

from conftest import LAYOUT, make_block, token_kv
from redis_servers import RedisServer
from stored import record_files

Factory = Callable[..., KVStore]
KEY = bytes(range(32))


def test_record_sealing_round_trip_and_tamper_detection() -> None:
    block = make_block(LAYOUT, 1)
    encoded = block.encode()
    keyring = Keyring(KEY)
    record = encode_record(block.key, encoded, LAYOUT.fingerprint, keyring=keyring, namespace="tenant-a")
    assert encoded.payload[:64] not in record  # no plaintext KV on disk
    header, opened = decode_record(record, keyring=keyring, expected_key=block.key)
    assert opened == encoded and header.encrypted and header.namespace == "tenant-a"
    with pytest.raises(EncryptionKeyError, match="no key"):
        decode_record(record)
    with pytest.raises(CorruptBlockError, match="authentication"):
        decode_record(record, keyring=Keyring(bytes(32)))  # another master key
    # a sealed payload moved under another block's key fails authentication, even with the CRC
    # recomputed (what someone with write access to the store could do)
    other = make_block(LAYOUT, 2)
    moved = bytearray(record[:-4])
    moved[32:64] = other.key  # the block-key field of the header
    moved += crc32c.crc32c(bytes(moved)).to_bytes(4, "little")
    with pytest.raises(CorruptBlockError, match="authentication"):
        decode_record(bytes(moved), keyring=keyring)
    # namespaces get different keys
    assert keyring.cipher("a") is not keyring.cipher("b")
    with pytest.raises(ConfigError):
        parse_master_key("abc")


def test_encrypted_store_round_trip_restart_and_missing_key(open_store: Factory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = open_store(root, encryption_key=KEY, l1_budget_bytes=0, l2_budget_bytes=0)
    session = store.create_session("s", "tenant-a")
    tokens = list(range(10))
    kv = token_kv(LAYOUT, tokens)
    store.append(session, tokens, kv)
    store.checkpoint(session)
    store.flush()
    files = record_files(root)
    assert files and all(kv[:, :, :, :4].numpy().tobytes()[:64] not in f.read_bytes() for f in files)
    store.close()

    reopened = open_store(root, encryption_key=KEY, l1_budget_bytes=0, l2_budget_bytes=0)
    loaded = reopened.load(reopened.session("s", "tenant-a"))
    assert loaded.tokens_by_tier == {TierLevel.L3: 10} and torch.equal(loaded.kv, kv)  # type: ignore[arg-type]
    reopened.close()

    with pytest.raises(EncryptionKeyError, match="encrypted at rest"):
        open_store(root, l1_budget_bytes=0, l2_budget_bytes=0)  # no key: refused for writing
    with pytest.raises(EncryptionKeyError, match="encrypted at rest"):  # reading (listing) too
        KVStore(root, read_only=True)
    assert all(f.exists() for f in files)  # not quarantined: the files are fine, the key is missing

    result = CliRunner().invoke(app, ["inspect", str(files[0])])
    assert result.exit_code == 0 and "tenant-a" in result.output  # CRC verified without the key
    data = bytearray(files[0].read_bytes())
    data[120] ^= 1
    files[0].write_bytes(bytes(data))
    assert CliRunner().invoke(app, ["inspect", str(files[0])]).exit_code == 1


def test_remote_values_are_sealed(open_store: Factory, tmp_path: Path, redis_server: RedisServer) -> None:
    import redis

    remote = RemoteConfig(redis_server.url, prefix=f"enc-{uuid.uuid4().hex[:8]}")
    store = open_store(tmp_path / "a", encryption_key=KEY, remote=remote)
    session = store.create_session("s", "tenant-b")
    tokens = list(range(8))
    kv = token_kv(LAYOUT, tokens)
    store.append(session, tokens, kv)
    store.checkpoint(session)
    store.flush()
    raw = redis.Redis.from_url(redis_server.url)
    value = raw.get(store.tiered.remote.tier._name(session.block_keys[0]))  # type: ignore[union-attr]
    assert value is not None and kv[:, :, :, :4].contiguous().numpy().tobytes()[:64] not in value
    tier = store.tiered.remote.tier  # type: ignore[union-attr]
    manifest = raw.hget(tier._session_name("tenant-b", "s"), "data")  # the session's token ids: sealed
    token_bytes = bytes(b"".join(t.to_bytes(4, "little") for t in tokens))
    assert manifest is not None and manifest.startswith(b"KVSM")
    assert token_bytes not in manifest and base64.b64encode(token_bytes) not in manifest
    other = open_store(
        tmp_path / "b", encryption_key=KEY, remote=remote, l1_budget_bytes=0, l2_budget_bytes=0
    )
    continued = other.session("s", "tenant-b")
    assert torch.equal(other.load(continued).kv, kv)  # type: ignore[arg-type]
    assert os.path.exists(tmp_path / "b")


def test_wrong_or_missing_key_is_refused_at_open_and_changes_nothing(
    open_store: Factory, tmp_path: Path
) -> None:
    """Issue 15, acceptance 6: right key, wrong key, no key, right key again: every session whole."""
    root = tmp_path / "store"
    store = open_store(root, encryption_key=KEY, l1_budget_bytes=0, l2_budget_bytes=0)
    expected = {}
    for i in range(3):
        session = store.create_session(f"s{i}", "tenant")
        tokens = list(range(i * 100, i * 100 + 9 + i))
        store.append(session, tokens, token_kv(LAYOUT, tokens))
        store.checkpoint(session)
        expected[f"s{i}"] = token_kv(LAYOUT, tokens)
    store.close()
    before = sorted((p.name, p.stat().st_size) for p in record_files(root))
    wrong = bytes(range(1, 33))
    for config in ({"encryption_key": wrong}, {}):
        with pytest.raises(EncryptionKeyError) as refused:
            open_store(root, l1_budget_bytes=0, l2_budget_bytes=0, **config)
        assert "\n" not in str(refused.value) and str(root) in str(
            refused.value
        )  # one line, naming the store
    with pytest.raises(EncryptionKeyError, match="wrong encryption key"):
        KVStore(root, read_only=True, config=StoreConfig(encryption_key=wrong))
    assert sorted((p.name, p.stat().st_size) for p in record_files(root)) == before
    assert not list((root / "quarantine").iterdir())
    again = open_store(root, encryption_key=KEY, l1_budget_bytes=0, l2_budget_bytes=0)
    for sid, kv in expected.items():
        loaded = again.load(again.session(sid, "tenant"))
        assert loaded.missing_from_token is None and torch.equal(loaded.kv, kv)  # type: ignore[arg-type]


def test_store_encrypted_before_check_values_gets_one_from_a_key_that_opens_it(
    open_store: Factory, tmp_path: Path
) -> None:
    from kvstrata.store.keycheck import KEY_CHECK_META

    root = tmp_path / "store"
    store = open_store(root, encryption_key=KEY, l1_budget_bytes=0, l2_budget_bytes=0)
    session = store.create_session("s", "tenant")
    store.append(session, list(range(8)), token_kv(LAYOUT, list(range(8))))
    store.checkpoint(session)
    store.close()
    db = sqlite3.connect(root / "index.sqlite")
    db.execute("DELETE FROM meta WHERE name = ?", (KEY_CHECK_META,))  # as written by an older build
    db.commit()
    db.close()
    with pytest.raises(EncryptionKeyError, match="do not open"):
        open_store(root, encryption_key=bytes(range(1, 33)), l1_budget_bytes=0, l2_budget_bytes=0)
    reopened = open_store(root, encryption_key=KEY, l1_budget_bytes=0, l2_budget_bytes=0)
    assert reopened.index.get_meta(KEY_CHECK_META) is not None
    assert reopened.load(reopened.session("s", "tenant")).num_tokens == 8
