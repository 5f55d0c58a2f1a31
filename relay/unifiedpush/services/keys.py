"""The UnifiedPush key ring: one 32-byte master key per UNIFIEDPUSH_KEYS entry.

Each master key yields, through HKDF-SHA256, three subkeys with separate jobs: the PASETO
v4.local key of endpoint tokens, the AES-256-GCM key that seals stored messages, and the HMAC
key of the keyed hashes that stand in for endpoints, accounts and topics in the database.
A key is named by its `kid` (a hash of the key, never the key): tokens carry it in their
footer and sealed messages in their first bytes, so the right key is found without trying
them all. The first key encrypts; every configured key decrypts (rotation: docs/unifiedpush.md).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
from dataclasses import dataclass

import pyseto
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from relay import conf

KID_LENGTH = 8  # characters (6 bytes of a hash, base64url)
NONCE_LENGTH = 12
HASH_LENGTH = 16  # bytes of HMAC-SHA256 kept: 128 bits, 32 hex characters


class BadKey(ValueError):
    """A UNIFIEDPUSH_KEYS entry is not base64 of exactly 32 bytes."""


class Unsealable(ValueError):
    """A sealed value names no configured key, or fails authentication."""


def decode_master_key(text: str) -> bytes:
    """base64 or base64url, padded or not, of exactly 32 bytes."""
    cleaned = text.strip().replace("-", "+").replace("_", "/")
    try:
        raw = base64.b64decode(cleaned + "=" * (-len(cleaned) % 4), validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadKey("not base64") from error
    if len(raw) != 32:
        raise BadKey(f"{len(raw)} bytes instead of 32")
    return raw


def new_master_key() -> str:
    """A fresh key as UNIFIEDPUSH_KEYS expects it."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")


def _subkey(master: bytes, purpose: bytes) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"relay unifiedpush " + purpose
    ).derive(master)


@dataclass(frozen=True)
class UnifiedPushKey:
    kid: str
    token_key: pyseto.KeyInterface
    sealing: AESGCM
    hashing: bytes

    def keyed_hash(self, purpose: bytes, value: bytes) -> str:
        """HMAC-SHA256 of `value` for one purpose, 128 bits in hex: what the database keeps."""
        digest = hmac.digest(self.hashing, purpose + b"\0" + value, "sha256")
        return digest[:HASH_LENGTH].hex()


def _make_key(master: bytes) -> UnifiedPushKey:
    kid_bytes = hashlib.sha256(b"relay unifiedpush kid\0" + master).digest()[:6]
    return UnifiedPushKey(
        kid=base64.urlsafe_b64encode(kid_bytes).decode(),
        token_key=pyseto.Key.new(version=4, purpose="local", key=_subkey(master, b"token")),
        sealing=AESGCM(_subkey(master, b"sealing")),
        hashing=_subkey(master, b"hashing"),
    )


@dataclass(frozen=True)
class KeyRing:
    keys: tuple[UnifiedPushKey, ...]

    @property
    def current(self) -> UnifiedPushKey:
        return self.keys[0]

    def by_kid(self, kid: str) -> UnifiedPushKey | None:
        for key in self.keys:
            if key.kid == kid:
                return key
        return None

    def seal(self, plain: bytes) -> bytes:
        """kid + nonce + AES-256-GCM(plain) under the current key."""
        key = self.current
        nonce = os.urandom(NONCE_LENGTH)
        header = key.kid.encode()
        return header + nonce + key.sealing.encrypt(nonce, plain, header)

    def unseal(self, sealed: bytes) -> bytes:
        header, nonce = sealed[:KID_LENGTH], sealed[KID_LENGTH : KID_LENGTH + NONCE_LENGTH]
        key = self.by_kid(header.decode("ascii", errors="replace"))
        if key is None:
            raise Unsealable("sealed with a key that is not configured")
        try:
            return key.sealing.decrypt(nonce, sealed[KID_LENGTH + NONCE_LENGTH :], header)
        except InvalidTag as error:
            raise Unsealable("authentication failed") from error

    def keyed_hashes(self, purpose: bytes, value: bytes) -> list[str]:
        """The keyed hash of `value` under every key (lookups across a rotation)."""
        return [key.keyed_hash(purpose, value) for key in self.keys]


@functools.cache
def _ring(entries: tuple[str, ...]) -> KeyRing:
    if not entries:
        raise BadKey("UNIFIEDPUSH_KEYS is empty")
    return KeyRing(tuple(_make_key(decode_master_key(entry)) for entry in entries))


def keyring() -> KeyRing:
    return _ring(tuple(conf.current().unifiedpush_keys))
