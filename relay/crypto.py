"""Credentials at rest: encrypted with keys from the environment, rotatable without downtime.

`CREDENTIAL_KEYS` holds one or more Fernet keys, comma separated. The first encrypts; every
key decrypts, so an operator adds a new key in front, runs `manage.py rotate_credentials`,
then drops the old key. Stored values carry a prefix so plain legacy text is still readable.
"""

from __future__ import annotations

import functools
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.db import models

from relay import conf

PREFIX = "enc:v1:"


class CredentialKeyError(Exception):
    """A stored credential cannot be decrypted with any configured key."""


@functools.cache
def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    return MultiFernet([Fernet(key.encode()) for key in keys])


def fernet() -> MultiFernet:
    return _fernet(tuple(conf.current().credential_keys))


def encrypt(plain: str) -> str:
    if not plain:
        return ""
    return PREFIX + fernet().encrypt(plain.encode()).decode()


def decrypt(stored: str) -> str:
    if not stored or not stored.startswith(PREFIX):
        return stored
    try:
        return fernet().decrypt(stored[len(PREFIX) :].encode()).decode()
    except InvalidToken as error:
        raise CredentialKeyError(
            "no configured CREDENTIAL_KEYS entry decrypts this value"
        ) from error


def needs_rotation(stored: str) -> bool:
    """True when the value is plain or not encrypted with the first (current) key."""
    if not stored:
        return False
    if not stored.startswith(PREFIX):
        return True
    primary = Fernet(conf.current().credential_keys[0].encode())
    try:
        primary.decrypt(stored[len(PREFIX) :].encode())
    except InvalidToken:
        return True
    return False


class UnreadableCredential(str):
    """A stored value no configured key decrypts; it holds the stored (encrypted) text.

    Loading a row must not crash because of one such value (the admin list, the app's other
    providers would go down with it). The credentials service refuses to use it, and saving
    the row back writes the same ciphertext unchanged.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "<UnreadableCredential>"


class EncryptedTextField(models.TextField):
    """A text field stored encrypted; Python code only ever sees the plain value."""

    def from_db_value(self, value: str | None, expression: Any, connection: Any) -> str | None:
        if value is None:
            return value
        try:
            return decrypt(value)
        except CredentialKeyError:
            return UnreadableCredential(value)

    def get_prep_value(self, value: Any) -> Any:
        value = super().get_prep_value(value)
        if value is None or value == "":
            return value
        if isinstance(value, str) and value.startswith(PREFIX):
            return value
        return encrypt(value)
