"""An app's credentials records: reading one (decrypted, every field of its provider's spec)
and replacing one, the only way they are written."""

from __future__ import annotations

import json
from typing import Any

from django.db import transaction
from django.dispatch import Signal
from django.utils import timezone

from relay.crypto import CredentialKeyError, UnreadableCredential
from relay.models import App, ProviderCredentials
from relay.providers.registry import spec_for
from relay.services.credentials.stored import UNREADABLE

# Sent after a record is replaced: sender App, `app`, `service`, `fields` the names whose
# values changed (never the values). The audit listens; model signals would see only a new row.
credentials_changed = Signal()

# The app instance keeps its records once read (a worker's cached App, the admin's form).
_KEPT = "_provider_credentials"


def records(app: App) -> dict[str, ProviderCredentials]:
    """The app's records by service: from a prefetch, else one query, then kept on the app."""
    kept: dict[str, ProviderCredentials] | None = app.__dict__.get(_KEPT)
    if kept is None:
        kept = {} if app.pk is None else {r.service: r for r in app.credentials.all()}
        app.__dict__[_KEPT] = kept
    return kept


def forget(app: App) -> None:
    app.__dict__.pop(_KEPT, None)


def _decoded(record: ProviderCredentials) -> dict[str, Any]:
    if isinstance(record.values, UnreadableCredential):
        raise CredentialKeyError(f"The {record.service} credentials {UNREADABLE}")
    decoded = json.loads(record.values or "{}")
    return decoded if isinstance(decoded, dict) else {}


def values_of(app: App, service: str) -> dict[str, Any]:
    """Every field of the provider's spec, "" (or False) where unset.

    Raises CredentialKeyError when no configured CREDENTIAL_KEYS entry decrypts the record."""
    record = records(app).get(service)
    return spec_for(service).complete(_decoded(record) if record is not None else {})


def unreadable_marker() -> UnreadableCredential:
    """What stands for a stored value no configured key decrypts."""
    return UnreadableCredential("")


def readable(app: App, service: str) -> bool:
    record = records(app).get(service)
    return record is None or not isinstance(record.values, UnreadableCredential)


def store(app: App, service: str, values: dict[str, Any]) -> bool:
    """Replace the app's record for `service` with `values` (validated by the caller); values
    all empty remove it. Returns whether anything changed.

    A changed record gets a new id and the app a new `updated`: a worker's cached provider
    and the Windows API's kept app are rebuilt on their next use.
    """
    spec = spec_for(service)
    complete = spec.complete(values)
    record = records(app).get(service)
    readable = record is not None and not isinstance(record.values, UnreadableCredential)
    if readable and record is not None and _decoded(record) == complete:
        return False
    empty = not any(complete.values())
    if record is None and empty:
        return False
    before = _decoded(record) if readable and record is not None else {}
    changed = sorted(name for name in complete if complete[name] != before.get(name))
    with transaction.atomic():
        ProviderCredentials.objects.filter(app=app, service=service).delete()
        if not empty:
            ProviderCredentials.objects.create(
                app=app,
                service=service,
                values=json.dumps(complete, sort_keys=True),
                not_after=spec.expiry(complete),
            )
        now = timezone.now()
        App.objects.filter(pk=app.pk).update(updated=now)
    app.updated = now
    forget(app)
    credentials_changed.send(sender=App, app=app, service=service, fields=changed)
    return True
