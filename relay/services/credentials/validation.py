"""What a valid credential is, so the admin form and `load_tenants` reject the same things
with the same words. Errors name the field and the problem, never the value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError

from relay.crypto import UnreadableCredential
from relay.models import App
from relay.providers.apns import (
    ApnsConfig,
    first_certificate,
    validate_apns_certificate,
    validate_apns_certificate_key,
    validate_apns_key,
    validate_ca_certificates,
)
from relay.providers.fcm import FcmConfig
from relay.providers.wns import WnsConfig
from relay.providers.wns import parse_host_pattern as parse_wns_host_pattern
from relay.services.credentials.stored import UNREADABLE, lines

_APPLE_ID = re.compile(r"[A-Z0-9]{10}")
_BUNDLE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-]*")
_PACKAGE_SID = re.compile(r"ms-app://s-1-15-2(?:-[0-9]+)+", re.IGNORECASE)


# --- validation (admin form and load_tenants) --------------------------------------------------


def certificate_not_after(pem: str | None) -> datetime | None:
    """When the (first) certificate in `pem` expires; None if there is none or it is unusable."""
    if not pem or isinstance(pem, UnreadableCredential):
        return None
    try:
        return first_certificate(pem).not_valid_after_utc
    except ValueError:
        return None


class _Errors:
    """Collects one message per field, then raises them together as a ValidationError."""

    def __init__(self) -> None:
        self.by_field: dict[str, str] = {}

    def add(self, field: str, message: str) -> None:
        self.by_field.setdefault(field, message)

    def raise_any(self) -> None:
        if self.by_field:
            raise ValidationError({field: [msg] for field, msg in self.by_field.items()})


def _value(values: Mapping[str, Any], name: str, errors: _Errors) -> str:
    value = values.get(name) or ""
    if isinstance(value, UnreadableCredential):
        errors.add(name, f"The stored value {UNREADABLE}.")
        return ""
    return str(value)


def validate_fcm(*, values: Mapping[str, Any]) -> None:
    """Raise ValidationError({field: message}) if the FCM fields cannot work."""
    errors = _Errors()
    service_account = _value(values, "fcm_service_account", errors)
    if service_account.strip():
        try:
            FcmConfig.parse(service_account, str(values.get("fcm_endpoint") or ""))
        except ValueError as error:
            field = "fcm_endpoint" if "endpoint" in str(error) else "fcm_service_account"
            errors.add(field, str(error))
    errors.raise_any()


def validate_apns(*, values: Mapping[str, Any]) -> None:
    """Raise ValidationError({field: message}) if the APNs fields cannot work."""
    errors = _Errors()
    key = _value(values, "apns_key", errors)
    certificate = _value(values, "apns_certificate", errors)
    private_key = _value(values, "apns_private_key", errors)
    if errors.by_field or not (key.strip() or certificate.strip() or private_key.strip()):
        errors.raise_any()
        return
    topic = str(values.get("apns_topic") or "")
    if not topic:
        errors.add("apns_topic", "The topic (the app's bundle id) is required for APNs.")
    elif not _BUNDLE_ID.fullmatch(topic):
        errors.add("apns_topic", "The topic must be a bundle id like org.example.app.")
    if key.strip() and (certificate.strip() or private_key.strip()):
        errors.add("apns_key", "Give either a .p8 key (token auth) or a certificate, not both.")
    elif key.strip():
        for name, what in (("apns_key_id", "key id"), ("apns_team_id", "team id")):
            if not _APPLE_ID.fullmatch(str(values.get(name) or "")):
                errors.add(name, f"Token auth needs the {what}: 10 capital letters or digits.")
        try:
            validate_apns_key(key)
        except ValueError as error:
            errors.add("apns_key", f"{error}.")
    elif not certificate.strip():
        errors.add("apns_certificate", "A private key was given without its certificate.")
    else:
        try:
            validate_apns_certificate(certificate)
        except ValueError as error:
            errors.add("apns_certificate", f"{error}.")
        else:
            try:
                validate_apns_certificate_key(certificate, private_key)
            except ValueError as error:
                errors.add("apns_private_key", f"{error}.")
    endpoint = str(values.get("apns_endpoint") or "")
    if endpoint:
        try:
            ApnsConfig(topic="-", endpoint=endpoint).address  # noqa: B018 -- raises if malformed
        except ValueError as error:
            errors.add("apns_endpoint", f"{error}.")
    ca = str(values.get("apns_ca_certificate") or "")
    if ca.strip():
        try:
            validate_ca_certificates(ca)
        except ValueError as error:
            errors.add("apns_ca_certificate", f"{error}.")
    errors.raise_any()


def validate_wns(*, values: Mapping[str, Any]) -> None:
    """Raise ValidationError({field: message}) if the WNS fields cannot work."""
    errors = _Errors()
    secret = _value(values, "wns_secret", errors)
    package_sid = str(values.get("wns_package_sid") or "")
    if errors.by_field or not (package_sid or secret):
        errors.raise_any()
        return
    if not _PACKAGE_SID.fullmatch(package_sid):
        errors.add("wns_package_sid", "The package SID must look like ms-app://s-1-15-2-….")
    if not secret:
        errors.add("wns_secret", "The client secret is required with a package SID.")
    elif secret != secret.strip():
        errors.add("wns_secret", "The client secret has surrounding whitespace (a paste error?).")
    token_url = str(values.get("wns_token_url") or "")
    if token_url:
        try:
            WnsConfig(package_sid="ms-app://s-1-15-2-1", secret="-", token_url=token_url).validate()
        except ValueError as error:
            errors.add("wns_token_url", f"{error}.")
    for pattern in lines(str(values.get("wns_channel_hosts") or "")):
        try:
            parse_wns_host_pattern(pattern)
        except ValueError as error:
            errors.add("wns_channel_hosts", f"{pattern!r}: {error}")
    errors.raise_any()


def validate_credentials(*, values: Mapping[str, Any]) -> None:
    """Every provider's fields at once; one ValidationError naming each bad field."""
    by_field: dict[str, list[str]] = {}
    for validate in (validate_fcm, validate_apns, validate_wns):
        try:
            validate(values=values)
        except ValidationError as error:
            for field, messages in error.message_dict.items():
                by_field.setdefault(field, []).extend(messages)
    if by_field:
        raise ValidationError(by_field)


def refresh_derived_fields(*, app: App) -> None:
    """Set what follows from the credentials (the certificate's expiry) before a save."""
    app.apns_certificate_not_after = certificate_not_after(app.apns_certificate)
