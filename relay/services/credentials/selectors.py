"""What the admin and the system checks read about credentials: expiring certificates and
a summary that shows no secret.
"""

from __future__ import annotations

import json
from datetime import timedelta

from django.db import models
from django.utils import timezone

from relay.crypto import UnreadableCredential
from relay.models import App
from relay.services.credentials.stored import credential_fingerprint

EXPIRY_WARNING_DAYS = 30


# --- selectors for the admin and checks --------------------------------------------------------


def certificates_expiring(*, within_days: int = EXPIRY_WARNING_DAYS) -> models.QuerySet[App]:
    """Apps whose APNs certificate expires within `within_days` (or already has), soonest first."""
    limit = timezone.now() + timedelta(days=within_days)
    return (
        App.objects.select_related("tenant")
        .filter(apns_certificate_not_after__isnull=False, apns_certificate_not_after__lte=limit)
        .order_by("apns_certificate_not_after")
    )


def expiry_warning(*, app: App, within_days: int = EXPIRY_WARNING_DAYS) -> str:
    """A sentence for the admin when the app's APNs certificate expires soon, else ""."""
    not_after = app.apns_certificate_not_after
    if not_after is None:
        return ""
    left = not_after - timezone.now()
    if left > timedelta(days=within_days):
        return ""
    if left <= timedelta(0):
        return f"The APNs certificate of {app} expired on {not_after:%Y-%m-%d}."
    return (
        f"The APNs certificate of {app} expires on {not_after:%Y-%m-%d} "
        f"(in {left.days} days): upload a new one."
    )


def credential_summary(*, app: App) -> list[tuple[str, str]]:
    """(label, text) lines describing the app's credentials without showing any secret."""
    lines = [("FCM service account", credential_fingerprint(app.fcm_service_account))]
    project = _service_account_project(app.fcm_service_account)
    if project:
        lines.append(("FCM project", project))
    lines.append(("APNs key", credential_fingerprint(app.apns_key)))
    lines.append(("APNs certificate", credential_fingerprint(app.apns_certificate)))
    if app.apns_certificate_not_after is not None:
        lines.append(("APNs certificate expires", f"{app.apns_certificate_not_after:%Y-%m-%d}"))
    lines.append(("WNS secret", credential_fingerprint(app.wns_secret)))
    return lines


def _service_account_project(value: str | None) -> str:
    """The project id, read cheaply (no key loading: lists show many apps)."""
    if not value or isinstance(value, UnreadableCredential):
        return ""
    try:
        info = json.loads(value)
    except ValueError:
        return ""
    project = info.get("project_id") if isinstance(info, dict) else None
    return project if isinstance(project, str) else ""
