"""Endpoint tokens: everything a POST needs to route a message, sealed into the URL.

A token is PASETO v4.local (XChaCha20 + BLAKE2b-MAC, through `pyseto`): encrypted and
authenticated, so the URL reveals nothing about the account and cannot be forged or altered.
Its payload is compact binary (an endpoint URL may not exceed 1000 bytes):

    version (1) | component id (8) | expiry, unix seconds (4) | endpoint id (8, random)
    | application (32) | instance (32) | full JID (UTF-8, the rest)

The footer holds the kid of the key that sealed it (authenticated, not secret). The random
endpoint id names this one endpoint: revocations and Topic replacement are keyed by it, so a
fresh registration of the same application and instance is a new endpoint.

This module is the one adapter around pyseto.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import struct
from dataclasses import dataclass

import pyseto

from relay.unifiedpush.services.keys import KeyRing, UnifiedPushKey, keyring

VERSION = 1
_HEADER = struct.Struct(">BQI8s32s32s")
MAX_TOKEN_LENGTH = 1000
# v4.local.<base64url payload>.<base64url footer>; nothing else is even decrypted.
_SHAPE = re.compile(r"v4\.local\.[A-Za-z0-9_-]{100,1000}\.[A-Za-z0-9_-]{11}")


class InvalidToken(Exception):
    """Malformed, tampered, truncated, sealed with an unknown key, or expired: all alike 404."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What a token says: where to deliver, for which application and instance, until when."""

    jid: str
    application: bytes
    instance: bytes
    component_id: int
    expires: int
    endpoint_id: bytes
    kid: str

    @property
    def application_b64(self) -> str:
        return base64.b64encode(self.application).decode()

    @property
    def instance_b64(self) -> str:
        return base64.b64encode(self.instance).decode()


def _footer(key: UnifiedPushKey) -> bytes:
    return key.kid.encode()


def issue(
    *,
    jid: str,
    application: bytes,
    instance: bytes,
    component_id: int,
    expires: int,
    ring: KeyRing | None = None,
) -> tuple[str, Endpoint]:
    """A new token (and what it holds) under the current key."""
    ring = ring or keyring()
    key = ring.current
    endpoint = Endpoint(
        jid=jid,
        application=application,
        instance=instance,
        component_id=component_id,
        expires=expires,
        endpoint_id=os.urandom(8),
        kid=key.kid,
    )
    payload = (
        _HEADER.pack(VERSION, component_id, expires, endpoint.endpoint_id, application, instance)
        + jid.encode()
    )
    token = pyseto.encode(key.token_key, payload, footer=_footer(key)).decode()
    return token, endpoint


def open_token(token: str, *, now: float, ring: KeyRing | None = None) -> Endpoint:
    """The endpoint a token names, or InvalidToken; an expired token is invalid too."""
    if len(token) > MAX_TOKEN_LENGTH or not _SHAPE.fullmatch(token):
        raise InvalidToken("malformed")
    ring = ring or keyring()
    footer = token.rsplit(".", 1)[1]
    try:
        kid = base64.urlsafe_b64decode(footer + "=").decode("ascii")
    except (binascii.Error, ValueError) as error:
        raise InvalidToken("malformed footer") from error
    key = ring.by_kid(kid)
    if key is None:
        raise InvalidToken("unknown key")
    try:
        payload = pyseto.decode(key.token_key, token).payload
    except (pyseto.PysetoError, ValueError, TypeError) as error:
        raise InvalidToken("does not authenticate") from error
    if not isinstance(payload, bytes) or len(payload) <= _HEADER.size:
        raise InvalidToken("short payload")
    version, component_id, expires, endpoint_id, application, instance = _HEADER.unpack_from(
        payload
    )
    if version != VERSION:
        raise InvalidToken("unknown version")
    if expires <= now:
        raise InvalidToken("expired")
    try:
        jid = payload[_HEADER.size :].decode()
    except UnicodeDecodeError as error:
        raise InvalidToken("bad JID") from error
    return Endpoint(
        jid=jid,
        application=application,
        instance=instance,
        component_id=component_id,
        expires=expires,
        endpoint_id=endpoint_id,
        kid=kid,
    )
