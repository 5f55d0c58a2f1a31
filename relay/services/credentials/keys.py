"""The keys credentials are encrypted with at rest: how the stored values stand against
CREDENTIAL_KEYS, and re-encryption with the current key (`manage.py rotate_credentials`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cryptography.fernet import Fernet, InvalidToken
from django.apps import apps as django_apps
from django.db import models
from django.db.models.functions import Cast
from django.dispatch import Signal

from relay import conf, crypto
from relay.crypto import CredentialKeyError, EncryptedTextField

log = logging.getLogger(__name__)


# --- keys at rest: status and rotation ---------------------------------------------------------


def _encrypted_fields() -> Iterator[tuple[type[models.Model], list[str]]]:
    for model in django_apps.get_models():
        names = [
            field.attname
            for field in model._meta.concrete_fields
            if isinstance(field, EncryptedTextField)
        ]
        if names:
            yield model, names


def _raw(name: str) -> Cast:
    """The column as stored: a plain TextField output skips EncryptedTextField's decryption."""
    return Cast(name, output_field=models.TextField())


def _raw_rows(model: type[models.Model], names: list[str]) -> Iterator[tuple[Any, ...]]:
    aliases = {f"raw_{name}": _raw(name) for name in names}
    return model._base_manager.annotate(**aliases).values_list("pk", *aliases).iterator()


@dataclass(frozen=True)
class KeyStatus:
    """How the stored credentials stand against the configured CREDENTIAL_KEYS."""

    stored: int = 0
    unreadable: int = 0
    rotation_pending: int = 0


def credential_key_status() -> KeyStatus:
    """Count stored values no key decrypts, and values not yet under the current key."""
    primary = Fernet(conf.current().credential_keys[0].encode())
    everyone = crypto.fernet()
    stored = unreadable = pending = 0
    for model, names in _encrypted_fields():
        for row in _raw_rows(model, names):
            for raw in row[1:]:
                if not raw:
                    continue
                stored += 1
                if not raw.startswith(crypto.PREFIX):
                    pending += 1
                    continue
                token = raw[len(crypto.PREFIX) :].encode()
                try:
                    primary.decrypt(token)
                except InvalidToken:
                    try:
                        everyone.decrypt(token)
                    except InvalidToken:
                        unreadable += 1
                    else:
                        pending += 1
    return KeyStatus(stored=stored, unreadable=unreadable, rotation_pending=pending)


# Sent for each row whose credentials `rotate_credentials` re-encrypted (a bulk update, which
# model signals do not see): sender the model, `pk`, `fields` the names. The audit listens.
credentials_rotated = Signal()


def rotate_credentials() -> int:
    """Re-encrypt every stored credential with the current (first) key; returns how many.

    Safe while the service runs: the plain values do not change (so `updated` is left alone
    and no provider is rebuilt), and each value is replaced only if it is still the one read
    (compare-and-set), so a credential saved meanwhile in the admin is never overwritten.
    Values no configured key decrypts are left as they are and logged.
    """
    rotated = 0
    for model, names in _encrypted_fields():
        for row in _raw_rows(model, names):
            pk = row[0]
            done: list[str] = []
            for name, raw in zip(names, row[1:], strict=True):
                if not raw or not crypto.needs_rotation(raw):
                    continue
                try:
                    plain = crypto.decrypt(raw)
                except CredentialKeyError:
                    log.warning(
                        "credentials.unreadable",
                        extra={"model": model._meta.label, "pk": pk, "field": name},
                    )
                    continue
                updated = (
                    model._base_manager.filter(pk=pk)
                    .alias(current=_raw(name))
                    .filter(current=raw)
                    .update(**{name: crypto.encrypt(plain)})
                )
                rotated += updated
                if updated:
                    done.append(name)
            if done:
                credentials_rotated.send(sender=model, pk=pk, fields=done)
    log.info("credentials.rotated", extra={"count": rotated})
    return rotated
