"""The Apple Push Notification service as the relay plugs it in: token auth (a .p8 key) or
certificate auth, and how they make a client."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from datetime import datetime
from pathlib import Path

from relay.providers.base import PushProvider
from relay.providers.payloads import apns_payload
from relay.providers.spec import BuildContext, CredentialField, ProviderSpec, Values

log = logging.getLogger(__name__)

_APPLE_ID = re.compile(r"[A-Z0-9]{10}")
_BUNDLE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-]*")


def _text(values: Values, name: str) -> str:
    return str(values.get(name) or "")


def _configured(values: Values) -> bool:
    return bool(_text(values, "key").strip() or _text(values, "certificate").strip())


def _validate(values: Values) -> dict[str, str]:
    from relay.providers.apns import (
        ApnsConfig,
        validate_apns_certificate,
        validate_apns_certificate_key,
        validate_apns_key,
        validate_ca_certificates,
    )

    errors: dict[str, str] = {}
    key, certificate = _text(values, "key"), _text(values, "certificate")
    private_key = _text(values, "private_key")
    if not (key.strip() or certificate.strip() or private_key.strip()):
        return errors
    topic = _text(values, "topic")
    if not topic:
        errors["topic"] = "The topic (the app's bundle id) is required for APNs."
    elif not _BUNDLE_ID.fullmatch(topic):
        errors["topic"] = "The topic must be a bundle id like org.example.app."
    if key.strip() and (certificate.strip() or private_key.strip()):
        errors["key"] = "Give either a .p8 key (token auth) or a certificate, not both."
    elif key.strip():
        for name, what in (("key_id", "key id"), ("team_id", "team id")):
            if not _APPLE_ID.fullmatch(_text(values, name)):
                errors[name] = f"Token auth needs the {what}: 10 capital letters or digits."
        try:
            validate_apns_key(key)
        except ValueError as error:
            errors["key"] = f"{error}."
    elif not certificate.strip():
        errors["certificate"] = "A private key was given without its certificate."
    else:
        try:
            validate_apns_certificate(certificate)
        except ValueError as error:
            errors["certificate"] = f"{error}."
        else:
            try:
                validate_apns_certificate_key(certificate, private_key)
            except ValueError as error:
                errors["private_key"] = f"{error}."
    endpoint = _text(values, "endpoint")
    if endpoint:
        try:
            ApnsConfig(topic="-", endpoint=endpoint).address  # noqa: B018 -- raises if malformed
        except ValueError as error:
            errors["endpoint"] = f"{error}."
    ca = _text(values, "ca_certificate")
    if ca.strip():
        try:
            validate_ca_certificates(ca)
        except ValueError as error:
            errors["ca_certificate"] = f"{error}."
    return errors


def ca_file(pem: str, var_dir: Path) -> str:
    """A file holding this trust store (aioapns and ssl want a path), "" for the system's.

    The file is named by the content's hash, so a changed CA gets a new file and concurrent
    workers never see a half-written one. A CA certificate is public: no secret on disk.
    """
    if not pem.strip():
        return ""
    name = f"{hashlib.sha256(pem.encode()).hexdigest()}.pem"
    for base in (var_dir, Path(tempfile.gettempdir())):
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


def _build(values: Values, context: BuildContext) -> PushProvider:
    from relay.providers.apns import ApnsConfig, ApnsProvider

    config = ApnsConfig(
        topic=_text(values, "topic"),
        sandbox=bool(values.get("sandbox")),
        key=_text(values, "key"),
        key_id=_text(values, "key_id"),
        team_id=_text(values, "team_id"),
        certificate=_text(values, "certificate"),
        private_key=_text(values, "private_key"),
        endpoint=_text(values, "endpoint"),
        ca_file=ca_file(_text(values, "ca_certificate"), context.var_dir),
    )
    config.validate()
    return ApnsProvider(config, timeout=context.timeout, payload=context.payload)


def certificate_not_after(values: Values) -> datetime | None:
    """When the (first) certificate expires; None for token auth or an unusable one."""
    from relay.providers.apns import first_certificate

    pem = _text(values, "certificate")
    if not pem.strip() or _text(values, "key").strip():
        return None
    try:
        return first_certificate(pem).not_valid_after_utc
    except ValueError:
        return None


SPEC = ProviderSpec(
    service="apns",
    label="Apple Push Notification service",
    code="APNS",
    description="Token auth (a .p8 key with key id and team id) or certificate auth (a "
    "certificate and its private key), not both.",
    fields=(
        CredentialField("topic", "Topic", help="The app's bundle id.", required=True),
        CredentialField("sandbox", "Sandbox", "bool", help="For development builds."),
        CredentialField(
            "key",
            ".p8 key (token auth)",
            "secret_text",
            help="The .p8 signing key (token auth).",
            upload=".p8,.pem",
        ),
        CredentialField("key_id", "Key id"),
        CredentialField("team_id", "Team id"),
        CredentialField(
            "certificate",
            "Certificate, PEM (certificate auth)",
            "secret_text",
            help="PEM certificate (cert auth).",
            upload=".pem,.crt,.cer",
        ),
        CredentialField(
            "private_key",
            "Certificate's private key, PEM",
            "secret_text",
            help="PEM key of the certificate.",
            upload=".pem,.key",
        ),
        CredentialField(
            "endpoint", "Endpoint", help="host[:port]; empty follows the sandbox switch."
        ),
        CredentialField(
            "ca_certificate",
            "CA certificate",
            "textarea",
            help="PEM trust store for the APNs endpoint; empty uses the system's.",
            yaml="ca",
        ),
    ),
    configured=_configured,
    validate=_validate,
    build=_build,
    expiry=certificate_not_after,
    payload=apns_payload,
)
