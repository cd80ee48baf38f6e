"""Session documents: small named blobs that belong to a session (``KVStore.documents``).

What a session holds besides its KV and token ids: the chat transcript of ``kvstrata chat``, the
stored responses of the Responses API (``response:<id>``). They live and die with the session:
``fork`` copies them, deleting the session (by hand, by TTL or by ``gc``) deletes them in the
same transaction as its row, export and import carry them, and every process that has the store
open sees the others' writes (they are rows of the index, :mod:`kvstrata.store.index.documents`).

Each document is checksummed (CRC32C over its row, checked on every read) and, in an encrypted
store, sealed with the namespace's key (AES-256-GCM, bound to its namespace, session and name, so
a sealed document cannot be moved to another session or name). Names are stored in the clear:
they must identify, not carry content (``chat``, ``response:<random id>``).

``find(name)`` looks a name up across a namespace (which session holds ``response:<id>``?):
names meant for it must be unique in the namespace (random ids are). A fork's copy never hides
the original: the session that wrote a document itself wins over one that inherited it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.crypto import NONCE_BYTES, Keyring
from kvstrata.errors import (
    ConfigError,
    CorruptBlockError,
    EncryptionKeyError,
    KVStrataError,
    SessionNotFoundError,
)
from kvstrata.store.index.documents import DocumentRow, DocumentTable, row_identity

MAX_NAME_CHARS = 256
MAX_DOCUMENT_BYTES = 16 << 20
"""A document is small (a transcript, a response); bigger data belongs in blocks or elsewhere."""
DEFAULT_NAMESPACE = "default"
_AAD_PREFIX = b"kvstrata-document-v1\x00"


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or "\x00" in name:
        raise ConfigError(f"invalid document name {name!r} (1..{MAX_NAME_CHARS} characters, no NUL)")
    return name


@dataclass(frozen=True, slots=True)
class Document:
    """One document as export and import carry it (plain bytes: sealed again where it lands)."""

    name: str
    data: bytes
    inherited: bool = False


class SessionDocuments:
    """Documents of the sessions of one store.

    ``session_exists(namespace, session_id)``: whether the session exists (the store's own
    lookup, which also finds a session another machine published to the remote tier); the
    index then checks the session's row in the transaction that writes the document.
    """

    def __init__(
        self,
        table: DocumentTable,
        keyring: Keyring | None,
        session_exists: Callable[[str, str], bool],
        *,
        read_only: bool = False,
    ) -> None:
        self._table = table
        self._keyring = keyring
        self._session_exists = session_exists
        self._read_only = read_only

    # -- the public API ------------------------------------------------------------------------
    def put(self, session_id: str, name: str, data: bytes, *, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Store ``data`` as the session's document ``name`` (replacing one of that name), in one
        transaction. ``SessionNotFoundError`` if the session does not exist."""
        self._writable()
        validate_name(name)
        data = bytes(data)
        if len(data) > MAX_DOCUMENT_BYTES:
            raise ConfigError(f"document {name!r} is {len(data)} bytes; at most {MAX_DOCUMENT_BYTES}")
        if not self._session_exists(namespace, session_id):
            raise SessionNotFoundError(f"no session {session_id!r} in namespace {namespace!r}")
        self._table.put(self._row(namespace, session_id, name, data, inherited=False))

    def get(self, session_id: str, name: str, *, namespace: str = DEFAULT_NAMESPACE) -> bytes | None:
        """The document's bytes, or None if the session has none of that name."""
        row = self._table.get(namespace, session_id, validate_name(name))
        return self._open(row) if row is not None else None

    def delete(self, session_id: str, name: str, *, namespace: str = DEFAULT_NAMESPACE) -> bool:
        """Delete the document; False if there was none."""
        self._writable()
        return self._table.delete(namespace, session_id, validate_name(name))

    def names(self, session_id: str, *, namespace: str = DEFAULT_NAMESPACE, prefix: str = "") -> list[str]:
        """The session's document names that start with ``prefix``, sorted."""
        return self._table.names(namespace, session_id, prefix)

    def find(self, name: str, *, namespace: str = DEFAULT_NAMESPACE) -> tuple[str, bytes] | None:
        """(session id, bytes) of the document called ``name`` in ``namespace``, or None. For
        names unique in their namespace; a fork's copy never hides the session that wrote it."""
        row = self._table.find(namespace, validate_name(name))
        return (row.session_id, self._open(row)) if row is not None else None

    # -- what a session's life does to them ------------------------------------------------------
    def copy(self, source_id: str, target_id: str, *, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Copy every document of ``source_id`` to ``target_id`` (a fork), marked as inherited;
        returns how many."""
        self._writable()
        rows = self._table.rows(namespace, source_id)
        if rows:
            self._table.put_many(
                [self._row(namespace, target_id, r.name, self._open(r), inherited=True) for r in rows]
            )
        return len(rows)

    def export(self, session_id: str, *, namespace: str = DEFAULT_NAMESPACE) -> list[Document]:
        """Every document of the session, opened (for an archive, which seals on its own)."""
        return [Document(r.name, self._open(r), r.inherited) for r in self._table.rows(namespace, session_id)]

    def restore(
        self, session_id: str, documents: list[Document], *, namespace: str = DEFAULT_NAMESPACE
    ) -> None:
        """Store ``documents`` for the session in one transaction (an import)."""
        self._writable()
        for doc in documents:
            validate_name(doc.name)
        if documents:
            self._table.put_many(
                [self._row(namespace, session_id, d.name, d.data, inherited=d.inherited) for d in documents]
            )

    def sweep_orphans(self) -> int:
        """Delete documents whose session is gone (gc); returns how many."""
        self._writable()
        return self._table.sweep_orphans()

    # -- sealing ---------------------------------------------------------------------------------
    def _row(
        self, namespace: str, session_id: str, name: str, data: bytes, *, inherited: bool
    ) -> DocumentRow:
        if self._keyring is None:
            return DocumentRow(namespace, session_id, name, data, sealed=False, inherited=inherited)
        nonce, sealed = self._keyring.seal(namespace, _aad(namespace, session_id, name), data)
        return DocumentRow(namespace, session_id, name, nonce + sealed, sealed=True, inherited=inherited)

    def _open(self, row: DocumentRow) -> bytes:
        if not row.sealed:
            return row.data
        where = f"session document {row.namespace}/{row.session_id}/{row.name}"
        if self._keyring is None:
            raise EncryptionKeyError(f"{where} is encrypted: give the store's key to read it")
        if len(row.data) < NONCE_BYTES:
            raise CorruptBlockError(f"{where}: sealed data too short")
        aad = _aad(row.namespace, row.session_id, row.name)
        return self._keyring.open(row.namespace, row.data[:NONCE_BYTES], aad, row.data[NONCE_BYTES:], where)

    def _writable(self) -> None:
        if self._read_only:
            raise KVStrataError("the store was opened read-only: its session documents cannot change")


def _aad(namespace: str, session_id: str, name: str) -> bytes:
    return _AAD_PREFIX + row_identity(namespace, session_id, name)
