"""The provider configs an app's stored credentials make (used by
`relay.services.provider_registry`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from relay import conf
from relay.models import App
from relay.providers.apns import ApnsConfig
from relay.providers.fcm import FcmConfig
from relay.providers.wns import DEFAULT_CHANNEL_HOSTS, DEFAULT_TOKEN_URL, WnsConfig
from relay.services.credentials.stored import CredentialsMissing, lines, plain

log = logging.getLogger(__name__)

# --- provider configs (used by relay.services.provider_registry) ----------------------------


def fcm_config(*, app: App) -> FcmConfig:
    """Raises CredentialsMissing, CredentialKeyError, or ValueError (bad credentials)."""
    service_account = plain(app.fcm_service_account, "The FCM service account")
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
    for base in (conf.current().var_dir, Path(tempfile.gettempdir())):
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
    key = plain(app.apns_key, "The APNs key")
    certificate = plain(app.apns_certificate, "The APNs certificate")
    private_key = plain(app.apns_private_key, "The APNs certificate's private key")
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
    hosts = lines(app.wns_channel_hosts)
    if hosts:
        return hosts
    return tuple(conf.current().wns_channel_hosts or DEFAULT_CHANNEL_HOSTS)


def wns_token_url(*, app: App) -> str:
    return app.wns_token_url or conf.current().wns_token_url or DEFAULT_TOKEN_URL


def wns_config(*, app: App) -> WnsConfig:
    """Raises CredentialsMissing, CredentialKeyError, or ValueError (bad credentials)."""
    secret = plain(app.wns_secret, "The WNS client secret")
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
