"""What the admin and the system checks read about credentials: expiring ones and a summary
that shows no secret."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import models
from django.utils import timezone

from relay.crypto import CredentialKeyError
from relay.models import App
from relay.providers.registry import PROVIDERS, spec_for
from relay.services.credentials import records
from relay.services.credentials.stored import credential_fingerprint

EXPIRY_WARNING_DAYS = 30


# --- selectors for the admin and checks --------------------------------------------------------


def certificates_expiring(*, within_days: int = EXPIRY_WARNING_DAYS) -> models.QuerySet[App]:
    """Apps with a credential that expires within `within_days` (or already has), soonest
    first; each annotated with `not_after`, its first such expiry."""
    limit = timezone.now() + timedelta(days=within_days)
    return (
        App.objects.select_related("tenant")
        .filter(credentials__not_after__isnull=False, credentials__not_after__lte=limit)
        .annotate(not_after=models.Min("credentials__not_after"))
        .order_by("not_after")
    )


def first_expiry(*, app: App) -> tuple[str, datetime] | None:
    """(provider label, when) of the app's credential that expires first, if any does."""
    found = [
        (spec_for(service).label, record.not_after)
        for service, record in records.records(app).items()
        if record.not_after is not None
    ]
    return min(found, key=lambda item: item[1]) if found else None


def expiry_warning(*, app: App, within_days: int = EXPIRY_WARNING_DAYS) -> str:
    """A sentence for the admin when one of the app's certificates expires soon, else ""."""
    first = first_expiry(app=app)
    if first is None:
        return ""
    label, not_after = first
    left = not_after - timezone.now()
    if left > timedelta(days=within_days):
        return ""
    if left <= timedelta(0):
        return f"The {label} certificate of {app} expired on {not_after:%Y-%m-%d}."
    return (
        f"The {label} certificate of {app} expires on {not_after:%Y-%m-%d} "
        f"(in {left.days} days): upload a new one."
    )


def credential_summary(*, app: App) -> list[tuple[str, str]]:
    """(label, text) lines describing the app's credentials without showing any secret."""
    lines: list[tuple[str, str]] = []
    for spec in PROVIDERS:
        if not records.readable(app, spec.service):
            lines.append((spec.label, credential_fingerprint(records.unreadable_marker())))
            continue
        try:
            values = records.values_of(app, spec.service)
        except CredentialKeyError:  # pragma: no cover - readable() said otherwise
            continue
        secrets = [field for field in spec.fields if field.secret]
        if not spec.configured(values):
            lines.append((spec.label, "not set"))
            continue
        for field in secrets:
            lines.append((f"{spec.code} {field.label}", credential_fingerprint(values[field.name])))
        lines.extend(spec.summary(values))
        record = records.records(app).get(spec.service)
        if record is not None and record.not_after is not None:
            lines.append((f"{spec.code} certificate expires", f"{record.not_after:%Y-%m-%d}"))
    return lines
