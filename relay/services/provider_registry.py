"""One provider instance per app, service and credentials version, reused across sends, and
one App (credentials decrypted) per app and version.

Credentials change in the admin: the cache key includes the app's `updated` time, so a worker
builds a fresh client on the next send and closes the old one, with no restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

from relay import conf
from relay.crypto import CredentialKeyError
from relay.models import App, Service
from relay.providers import payloads
from relay.providers.base import PushProvider
from relay.services.credentials import configs
from relay.services.credentials.stored import CredentialsMissing

log = logging.getLogger(__name__)
T = TypeVar("T")


class NotConfigured(Exception):
    """The app has no usable credentials for this provider."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _configured(app: App, prefix: str, build: Callable[[], PushProvider]) -> PushProvider:
    """Build a provider, turning any credentials problem into NotConfigured with a code.

    `<P>_NOT_CONFIGURED`: nothing stored; `<P>_CREDENTIALS_UNREADABLE`: no configured
    CREDENTIAL_KEYS entry decrypts them; `<P>_BAD_CREDENTIALS`: they do not validate.
    """
    try:
        return build()
    except CredentialsMissing as error:
        raise NotConfigured(f"{prefix}_NOT_CONFIGURED") from error
    except CredentialKeyError as error:
        log.error(
            "registry.credentials_unreadable", extra={"provider": prefix.lower(), "app": app.pk}
        )
        raise NotConfigured(f"{prefix}_CREDENTIALS_UNREADABLE") from error
    except ValueError as error:
        log.warning("registry.bad_credentials", extra={"provider": prefix.lower(), "app": app.pk})
        raise NotConfigured(f"{prefix}_BAD_CREDENTIALS") from error


def _payload(prefix: str, parse: Callable[[object], T], app: App) -> T:
    """The app's payload shape for one provider (relay/providers/payloads.py)."""
    try:
        return parse(app.payload_options)
    except ValueError as error:
        log.warning("registry.bad_payload_options", extra={"provider": prefix.lower()})
        raise NotConfigured(f"{prefix}_BAD_PAYLOAD_OPTIONS") from error


def _timeout() -> float:
    """Every provider's HTTP timeout (RELAY_PROVIDER_TIMEOUT_SECONDS)."""
    return conf.current().provider_timeout_seconds


def _build_fcm(app: App) -> PushProvider:
    from relay.providers.fcm import FcmProvider

    payload = _payload("FCM", payloads.fcm_payload, app)
    current = conf.current()
    # The provider is Django-free: the CA bundle's settings reach it from here.
    ca_bundle = current.requests_ca_bundle or current.curl_ca_bundle
    return _configured(
        app,
        "FCM",
        lambda: FcmProvider(
            configs.fcm_config(app=app), timeout=_timeout(), payload=payload, ca_bundle=ca_bundle
        ),
    )


def _build_apns(app: App) -> PushProvider:
    from relay.providers.apns import ApnsProvider

    payload = _payload("APNS", payloads.apns_payload, app)
    return _configured(
        app,
        "APNS",
        lambda: ApnsProvider(configs.apns_config(app=app), timeout=_timeout(), payload=payload),
    )


def _build_wns(app: App) -> PushProvider:
    from relay.providers.wns import WnsProvider

    payload = _payload("WNS", payloads.wns_payload, app)
    return _configured(
        app,
        "WNS",
        lambda: WnsProvider(configs.wns_config(app=app), timeout=_timeout(), payload=payload),
    )


BUILDERS: dict[str, Callable[[App], PushProvider]] = {
    Service.FCM: _build_fcm,
    Service.APNS: _build_apns,
    Service.WNS: _build_wns,
}

_lock = threading.Lock()
_cache: dict[tuple[int, str], tuple[datetime, PushProvider]] = {}
_apps: dict[int, App] = {}


def apps(versions: dict[int, datetime]) -> dict[int, App]:
    """The apps by id, `versions` giving each one's current `updated` (read with the batch):
    an App is loaded from the database only when unseen or changed since.

    Loading one means compiling its query and decrypting its credentials, a large part of a
    worker's time at one push per batch. Every save moves `updated`, so an edit (credentials,
    endpoints, payload options, its tenant) is seen on the next batch.
    """
    found: dict[int, App] = {}
    missing: set[int] = set()
    for app_id, updated in versions.items():
        app = _apps.get(app_id)
        if app is not None and app.updated == updated:
            found[app_id] = app
        else:
            missing.add(app_id)
    if missing:
        loaded = App.objects.in_bulk(missing)
        _apps.update(loaded)
        found.update(loaded)
    return found


def provider_for(app: App, service: str) -> PushProvider:
    """The app's provider for `service`; rebuilt when the app changed (`updated`).

    The replaced provider is closed after the lock is released, also when the new
    credentials turn out unusable (then NotConfigured is raised and nothing stays cached).
    """
    key = (app.pk, service)
    stale: PushProvider | None = None
    try:
        with _lock:
            cached = _cache.get(key)
            if cached is not None and cached[0] == app.updated:
                return cached[1]
            builder = BUILDERS.get(service)
            if builder is None:
                raise NotConfigured(f"{service.upper()}_NOT_SUPPORTED")
            if cached is not None:
                stale = _cache.pop(key)[1]
            provider = builder(app)
            _cache[key] = (app.updated, provider)
            return provider
    finally:
        if stale is not None:
            stale.close()


def close_all() -> None:
    with _lock:
        providers = [provider for _, provider in _cache.values()]
        _cache.clear()
        _apps.clear()
    for provider in providers:
        provider.close()
