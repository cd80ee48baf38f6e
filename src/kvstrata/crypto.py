"""Encryption at rest: AES-256-GCM per namespace (tenant), for L3 files and remote values, the
session rows' token ids and the session documents; and per purpose, for archives and the audit log.

One master key (32 bytes) is given to the store; each namespace's key is derived from it with
HKDF-SHA256 (info = the namespace), so tenants never share a key and no key list needs storing.
A record is sealed with a fresh 96-bit nonce; the additional authenticated data binds the block
key, layout, codec, token count and start position, so a sealed payload cannot be moved to another
block or replayed under another header. Any tampering fails authentication and is reported as a
corrupt block; a record for which no key is configured is reported as unreadable, never guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstrata.errors import ConfigError, CorruptBlockError

KEY_BYTES = 32
NONCE_BYTES = 12


def parse_master_key(text: str) -> bytes:
    """A master key from 64 hex characters (how ``KVSTRATA_ENCRYPTION_KEY`` carries it)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError as exc:
        raise ConfigError("the encryption key must be 64 hex characters (32 bytes)") from exc
    if len(key) != KEY_BYTES:
        raise ConfigError(f"the encryption key must be {KEY_BYTES} bytes, got {len(key)}")
    return key


@dataclass(slots=True)
class Keyring:
    master_key: bytes
    _ciphers: dict[str, AESGCM] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.master_key) != KEY_BYTES:
            raise ConfigError(f"the encryption master key must be {KEY_BYTES} bytes")

    def cipher(self, namespace: str) -> AESGCM:
        cipher = self._ciphers.get(namespace)
        if cipher is None:
            derived = HKDF(
                algorithm=hashes.SHA256(),
                length=KEY_BYTES,
                salt=b"kvstrata-at-rest-v1",
                info=namespace.encode(),
            ).derive(self.master_key)
            cipher = self._ciphers[namespace] = AESGCM(derived)
        return cipher

    def check_value(self) -> str:
        """A value that identifies the master key without revealing it (HKDF under its own label,
        then HMAC of a constant): stored with the store, so that a wrong key is refused at open
        instead of being discovered block by block."""
        derived = HKDF(
            algorithm=hashes.SHA256(), length=KEY_BYTES, salt=b"kvstrata-key-check-v1", info=b"check"
        ).derive(self.master_key)
        mac = hmac.HMAC(derived, hashes.SHA256())
        mac.update(b"kvstrata encryption key check value")
        return mac.finalize()[:16].hex()

    def purpose_cipher(self, purpose: str) -> AESGCM:
        """A key of its own for one use that belongs to no namespace (archives, the audit log),
        derived under another label than namespace keys, so it never equals a tenant's."""
        label = f"\x00purpose:{purpose}"
        cipher = self._ciphers.get(label)
        if cipher is None:
            derived = HKDF(
                algorithm=hashes.SHA256(),
                length=KEY_BYTES,
                salt=b"kvstrata-purpose-v1",
                info=purpose.encode(),
            ).derive(self.master_key)
            cipher = self._ciphers[label] = AESGCM(derived)
        return cipher

    def seal_bytes(self, purpose: str, aad: bytes, plaintext: bytes) -> bytes:
        """``plaintext`` sealed under the key of ``purpose``: nonce then ciphertext and tag."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self.purpose_cipher(purpose).encrypt(nonce, plaintext, aad)

    def open_bytes(self, purpose: str, aad: bytes, sealed: bytes, what: str) -> bytes:
        """What :meth:`seal_bytes` sealed; ``CorruptBlockError`` naming ``what`` if it does not open."""
        try:
            if len(sealed) < NONCE_BYTES:
                raise InvalidTag
            return self.purpose_cipher(purpose).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
        except InvalidTag as exc:
            raise CorruptBlockError(
                f"{what} failed authentication (damaged, or sealed with another key)"
            ) from exc

    def seal(self, namespace: str, aad: bytes, plaintext: bytes) -> tuple[bytes, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        return nonce, self.cipher(namespace).encrypt(nonce, plaintext, aad)

    def open(self, namespace: str, nonce: bytes, aad: bytes, ciphertext: bytes, where: str | None) -> bytes:
        try:
            return self.cipher(namespace).decrypt(nonce, ciphertext, aad)
        except InvalidTag as exc:
            raise CorruptBlockError(
                f"encrypted payload failed authentication (tampered, or sealed with another key) "
                f"for namespace {namespace!r}",
                where,
            ) from exc
