"""System checks: credentials a configured key cannot read, pending rotations, expiring certs.

They run with `manage.py check` (and migrate, runserver), so an operator who dropped a key
too early hears about it before the first push fails. One small query per table that holds
encrypted values; a database that is not there yet (first migrate) is skipped silently.
"""

from __future__ import annotations

from typing import Any

from cryptography.fernet import Fernet
from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register
from django.db import DatabaseError


@register("relay")
def credential_keys_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    keys = list(getattr(settings, "CREDENTIAL_KEYS", []) or [])
    if not keys:
        return [Error("CREDENTIAL_KEYS is empty: credentials cannot be stored.", id="relay.E001")]
    for index, key in enumerate(keys):
        try:
            Fernet(key.encode())
        except (ValueError, TypeError):
            return [
                Error(
                    f"CREDENTIAL_KEYS entry {index + 1} is not a Fernet key.",
                    hint="Generate one with: python -c 'from cryptography.fernet import "
                    "Fernet; print(Fernet.generate_key().decode())'",
                    id="relay.E002",
                )
            ]
    from relay.services import credentials

    try:
        status = credentials.credential_key_status()
        expiring = list(credentials.certificates_expiring()[:20])
    except DatabaseError:
        return []
    messages: list[CheckMessage] = []
    if status.unreadable:
        messages.append(
            Warning(
                f"{status.unreadable} stored credential value(s) cannot be decrypted with any "
                "configured CREDENTIAL_KEYS entry; those providers will not send.",
                hint="Add the key they were encrypted with back to CREDENTIAL_KEYS, "
                "or enter the credentials again in the admin.",
                id="relay.W001",
            )
        )
    if status.rotation_pending:
        messages.append(
            Warning(
                f"{status.rotation_pending} stored credential value(s) are not encrypted with "
                "the current (first) CREDENTIAL_KEYS entry.",
                hint="Run `manage.py rotate_credentials` before removing old keys.",
                id="relay.W002",
            )
        )
    for app in expiring:
        messages.append(
            Warning(credentials.expiry_warning(app=app) or f"{app}: certificate", id="relay.W003")
        )
    return messages


@register("relay")
def unifiedpush_keys_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """UNIFIEDPUSH_KEYS must be 32-byte keys; stored messages sealed with a key that is no
    longer configured cannot be delivered (the key was dropped before they expired)."""
    from relay.services.unifiedpush import keys

    entries = list(getattr(settings, "UNIFIEDPUSH_KEYS", []) or [])
    if not entries:
        return [Error("UNIFIEDPUSH_KEYS is empty: no endpoint can be issued.", id="relay.E010")]
    for index, entry in enumerate(entries):
        try:
            keys.decode_master_key(entry)
        except keys.BadKey as error:
            return [
                Error(
                    f"UNIFIEDPUSH_KEYS entry {index + 1} is not base64 of 32 bytes ({error}).",
                    hint="Generate one with: python -c 'import base64, os; "
                    "print(base64.urlsafe_b64encode(os.urandom(32)).decode())'",
                    id="relay.E011",
                )
            ]
    from relay.services.unifiedpush import store

    try:
        unreadable = store.count_sealed_with_other_keys([key.kid for key in keys.keyring().keys])
    except DatabaseError:
        return []
    if unreadable:
        return [
            Warning(
                f"{unreadable} stored UnifiedPush message(s) are sealed with a key that is not "
                "in UNIFIEDPUSH_KEYS; they cannot be delivered.",
                hint="Put the old key back (after the new one) until they expire.",
                id="relay.W010",
            )
        ]
    return []
