"""Refusing a wrong or missing encryption key at open, before anything is read or changed.

An encrypted store records a check value of its master key (never the key: see
:meth:`kvstrata.crypto.Keyring.check_value`) in its index. A process that opens it with another
key is refused with one line, and one that opens it with no key at all likewise (listing its
sessions, or its statistics, needs the key as reading them does): a
misconfigured replica must not find out block by block (every read failing authentication) or,
worse, write blocks in the clear beside sealed ones. A store encrypted before check values were
recorded gets one on its first open with a key that opens one of its sealed blocks.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError, EncryptionKeyError
from kvstrata.store.index import Index
from kvstrata.store.kvbin import FLAG_ENCRYPTED, decode_record, parse_header
from kvstrata.store.tiers.disk.cold_dir import recorded_cold_dir
from kvstrata.store.tiers.disk.fileio import read_range
from kvstrata.store.tiers.disk.files import block_path, segment_path

KEY_CHECK_META = "encryption_key_check"
SESSIONS_SEALED_META = "session_rows_sealed"
_SAMPLE_BLOCKS = 64


def check_encryption_key(root: Path, index: Index, key: bytes | None, *, read_only: bool) -> None:
    stored = index.get_meta(KEY_CHECK_META)
    if key is None:
        if stored is not None:  # reading too: its sessions, their ids and sizes are its business
            raise EncryptionKeyError(
                f"store {root} is encrypted at rest: give its key (KVSTRATA_ENCRYPTION_KEY, or "
                "StoreConfig.encryption_key) to open it"
            )
        return
    keyring = Keyring(key)
    value = keyring.check_value()
    if stored is not None:
        if stored != value:
            raise EncryptionKeyError(
                f"wrong encryption key for store {root}: it was written with another key; nothing was "
                "read or changed (set the right KVSTRATA_ENCRYPTION_KEY)"
            )
        if not read_only:
            _seal_session_rows(index)
        return
    if read_only:
        return
    if not _opens_a_sealed_block(root, index, keyring):
        raise EncryptionKeyError(
            f"wrong encryption key for store {root}: its sealed blocks do not open with it; nothing was "
            "changed (set the right KVSTRATA_ENCRYPTION_KEY)"
        )
    with index.transaction() as db:  # two processes opening a new store at once: the first one's key
        db.execute("INSERT OR IGNORE INTO meta(name, value) VALUES (?, ?)", (KEY_CHECK_META, value))
        recorded = db.execute("SELECT value FROM meta WHERE name = ?", (KEY_CHECK_META,)).fetchone()[0]
    if recorded != value:
        raise EncryptionKeyError(
            f"wrong encryption key for store {root}: another process opened it with another key "
            "first; nothing was read or changed (set the right KVSTRATA_ENCRYPTION_KEY)"
        )
    _seal_session_rows(index)


def _seal_session_rows(index: Index) -> None:
    """Seal the token ids of session rows written before the store had a key (once: the mark
    says it was done; every writer since has had the key, so every row since is sealed)."""
    if index.get_meta(SESSIONS_SEALED_META) != "1":
        index.sessions.seal_all()
        index.set_meta(SESSIONS_SEALED_META, "1")


def _opens_a_sealed_block(root: Path, index: Index, keyring: Keyring) -> bool:
    """True unless a sealed block of the store fails to open with ``keyring`` (a store with no
    sealed block, or none readable, accepts the key)."""
    cold_dir = recorded_cold_dir(root)  # the store's cold directory, if it has one
    for row in itertools.islice(index.blocks, _SAMPLE_BLOCKS):
        try:
            if row.offset is not None:
                data = read_range(segment_path(root, row.file_id), row.offset, row.nbytes, None, cold=False)
            else:
                data = block_path(root, row.key, row.cold, row.file_id, cold_dir).read_bytes()
            if not parse_header(data).flags & FLAG_ENCRYPTED:
                continue
        except (OSError, CorruptBlockError):
            continue
        try:
            decode_record(data, keyring=keyring)
        except CorruptBlockError:
            return False
        return True
    return True
