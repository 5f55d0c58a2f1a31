"""Provider credentials of an app: validation, provider configs, display, expiry and rotation.

One place decides what a valid credential is, so the admin form and `load_tenants` reject the
same things with the same words, and the provider registry builds its configs from it.
Secrets never leave this module in a message: errors name the field and the problem, and the
admin shows a fingerprint (`credential_fingerprint`) instead of the value.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from django.apps import apps as django_apps
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models.functions import Cast
from django.utils import timezone

from relay import crypto
from relay.crypto import CredentialKeyError, EncryptedTextField, UnreadableCredential
from relay.models import App
from relay.providers.apns import ApnsConfig
from relay.providers.fcm import FcmConfig
from relay.providers.wns import DEFAULT_CHANNEL_HOSTS, DEFAULT_TOKEN_URL, WnsConfig
from relay.providers.wns import parse_host_pattern as parse_wns_host_pattern

log = logging.getLogger(__name__)

EXPIRY_WARNING_DAYS = 30
UNREADABLE = "cannot be decrypted with the configured CREDENTIAL_KEYS; enter it again"

_PEM_BLOCK = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----.+?-----END \1-----", re.DOTALL)
_APPLE_ID = re.compile(r"[A-Z0-9]{10}")
_BUNDLE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-]*")
_PACKAGE_SID = re.compile(r"ms-app://s-1-15-2(?:-[0-9]+)+", re.IGNORECASE)


class CredentialsMissing(Exception):
    """The app has no credentials for this provider at all (not an error in them)."""


# --- reading a stored value -------------------------------------------------------------------


def _plain(value: str | None, what: str) -> str:
    """The usable plain text of a stored credential; refuses one no configured key decrypts."""
    if isinstance(value, UnreadableCredential):
        raise CredentialKeyError(f"{what} {UNREADABLE}")
    return value or ""


def credential_fingerprint(value: str | None) -> str:
    """What the admin shows instead of a secret: whether it is set and a short hash of it."""
    if isinstance(value, UnreadableCredential):
        return "set · cannot be decrypted with the configured keys"
    if not value:
        return "not set"
    digest = hashlib.sha256(value.encode()).hexdigest()
    return f"set · sha256 {digest[:12]}…"


# --- provider configs (used by relay.services.provider_registry) ----------------------------


def fcm_config(*, app: App) -> FcmConfig:
    """Raises CredentialsMissing, CredentialKeyError, or ValueError (bad credentials)."""
    service_account = _plain(app.fcm_service_account, "The FCM service account")
    if not service_account.strip():
        raise CredentialsMissing("fcm")
    return FcmConfig.parse(service_account, app.fcm_endpoint)


def apns_ca_file(pem: str) -> str:
    """A file holding this trust store (aioapns and ssl want a path), "" for the system's.

    The file is named by the content's hash, so a changed CA gets a new file and concurrent
    workers never see a half-written one. A CA certificate is public: no secret on disk.
    """
    if not pem.strip():
        return ""
    name = f"{hashlib.sha256(pem.encode()).hexdigest()}.pem"
    for base in (Path(settings.VAR_DIR), Path(tempfile.gettempdir())):
        folder = base / "apns-ca"
        path = folder / name
        if path.exists():
            return str(path)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            descriptor, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(descriptor, "w") as handle:
                handle.write(pem)
            os.replace(temporary, path)
        except OSError as error:
            log.warning("credentials.ca_file_not_written", extra={"error": error.strerror})
            continue
        return str(path)
    raise ValueError("The APNs trust store cannot be written to a file")


def apns_config(*, app: App) -> ApnsConfig:
    """Raises CredentialsMissing, CredentialKeyError, or ValueError (bad credentials)."""
    key = _plain(app.apns_key, "The APNs key")
    certificate = _plain(app.apns_certificate, "The APNs certificate")
    private_key = _plain(app.apns_private_key, "The APNs certificate's private key")
    if not key.strip() and not certificate.strip():
        raise CredentialsMissing("apns")
    config = ApnsConfig(
        topic=app.apns_topic,
        sandbox=app.apns_sandbox,
        key=key,
        key_id=app.apns_key_id,
        team_id=app.apns_team_id,
        certificate=certificate,
        private_key=private_key,
        endpoint=app.apns_endpoint,
        ca_file=apns_ca_file(app.apns_ca_certificate),
    )
    config.validate()
    return config


def wns_channel_hosts(*, app: App) -> tuple[str, ...]:
    """Where this app's channel URIs may point: the app's list, else the site default."""
    hosts = _lines(app.wns_channel_hosts)
    if hosts:
        return hosts
    return tuple(settings.RELAY.get("WNS_CHANNEL_HOSTS") or DEFAULT_CHANNEL_HOSTS)


def wns_token_url(*, app: App) -> str:
    return app.wns_token_url or settings.RELAY.get("WNS_TOKEN_URL") or DEFAULT_TOKEN_URL


def wns_config(*, app: App) -> WnsConfig:
    """Raises CredentialsMissing, CredentialKeyError, or ValueError (bad credentials)."""
    secret = _plain(app.wns_secret, "The WNS client secret")
    if not app.wns_package_sid.strip() and not secret:
        raise CredentialsMissing("wns")
    config = WnsConfig(
        package_sid=app.wns_package_sid,
        secret=secret,
        token_url=wns_token_url(app=app),
        channel_hosts=wns_channel_hosts(app=app),
    )
    config.validate()
    return config


def _lines(text: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in (text or "").splitlines() if line.strip())


# --- validation (admin form and load_tenants) --------------------------------------------------


def _pem_blocks(text: str, kind: str) -> list[str]:
    return [m.group(0) for m in _PEM_BLOCK.finditer(text) if m.group(1).endswith(kind)]


def _load_private_key(pem: str, what: str) -> Any:
    try:
        return serialization.load_pem_private_key(pem.strip().encode(), password=None)
    except TypeError:  # "password was not given"
        raise ValueError(f"{what} is encrypted; give it without a passphrase") from None
    except (ValueError, UnsupportedAlgorithm):
        raise ValueError(f"{what} is not a PEM private key") from None


def _describe_key(key: Any) -> str:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        curve = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
        return f"an EC {curve.get(key.curve.name, key.curve.name)} key"
    if isinstance(key, rsa.RSAPrivateKey):
        return f"an RSA {key.key_size}-bit key"
    return f"a {type(key).__name__.removeprefix('_')}"


def _spki(public_key: Any) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _first_certificate(pem: str) -> x509.Certificate:
    blocks = _pem_blocks(pem, "CERTIFICATE")
    if not blocks:
        raise ValueError("The APNs certificate is not a PEM certificate")
    try:
        return x509.load_pem_x509_certificate(blocks[0].encode())
    except ValueError:
        raise ValueError("The APNs certificate cannot be parsed") from None


def validate_apns_key(pem: str) -> None:
    """A .p8 token-auth key: an unencrypted EC P-256 private key."""
    key = _load_private_key(pem, "The APNs key")
    if not (isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"):
        raise ValueError(f"The APNs key must be an EC P-256 (.p8) key, not {_describe_key(key)}")


def validate_apns_certificate(certificate: str) -> datetime:
    """Certificate auth: parses, is valid now, and the key belongs to it; returns not-after."""
    cert = _first_certificate(certificate)
    now = timezone.now()
    if cert.not_valid_after_utc <= now:
        raise ValueError(
            f"The APNs certificate expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        )
    if cert.not_valid_before_utc > now:
        raise ValueError(
            f"The APNs certificate is not valid before {cert.not_valid_before_utc:%Y-%m-%d} UTC"
        )
    return cert.not_valid_after_utc


def validate_apns_certificate_key(certificate: str, private_key: str) -> None:
    blocks = _pem_blocks(private_key or certificate, "PRIVATE KEY")
    if not blocks:
        raise ValueError("Certificate auth needs the certificate's private key (PEM)")
    key = _load_private_key(blocks[0], "The certificate's private key")
    if _spki(_first_certificate(certificate).public_key()) != _spki(key.public_key()):
        raise ValueError("The private key does not belong to the APNs certificate")


def validate_ca_certificates(pem: str) -> None:
    if not _pem_blocks(pem, "CERTIFICATE"):
        raise ValueError("The trust store must hold PEM certificates")
    try:
        x509.load_pem_x509_certificates(pem.encode())
    except ValueError:
        raise ValueError("The trust store holds a certificate that cannot be parsed") from None


def certificate_not_after(pem: str | None) -> datetime | None:
    """When the (first) certificate in `pem` expires; None if there is none or it is unusable."""
    if not pem or isinstance(pem, UnreadableCredential):
        return None
    try:
        return _first_certificate(pem).not_valid_after_utc
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
    for pattern in _lines(str(values.get("wns_channel_hosts") or "")):
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
    primary = Fernet(settings.CREDENTIAL_KEYS[0].encode())
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
                rotated += (
                    model._base_manager.filter(pk=pk)
                    .alias(current=_raw(name))
                    .filter(current=raw)
                    .update(**{name: crypto.encrypt(plain)})
                )
    log.info("credentials.rotated", extra={"count": rotated})
    return rotated
