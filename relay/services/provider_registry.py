"""One provider instance per app, service and credentials version, reused across sends, and
one App (credentials decrypted) per app and version.

Credentials change in the admin: the cache key includes the app's `updated` time, so a worker
builds a fresh client on the next send and closes the old one, with no restart.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from typing import Any

from relay import conf
from relay.crypto import CredentialKeyError
from relay.models import App
from relay.providers.base import PushProvider
from relay.providers.registry import BY_SERVICE
from relay.providers.spec import BuildContext, ProviderSpec
from relay.services.credentials import records

log = logging.getLogger(__name__)


class NotConfigured(Exception):
    """The app has no usable credentials for this provider."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _setting(name: str) -> Any:
    """A site setting a provider falls back to (relay.environment declares it)."""
    return getattr(conf.current(), name)


def build(app: App, spec: ProviderSpec) -> PushProvider:
    """The app's client for this provider, or NotConfigured with a code saying why:

    `<P>_NOT_CONFIGURED`: nothing stored; `<P>_CREDENTIALS_UNREADABLE`: no configured
    CREDENTIAL_KEYS entry decrypts them; `<P>_BAD_CREDENTIALS`: they do not validate;
    `<P>_BAD_PAYLOAD_OPTIONS`: the app's payload options for it do not.
    """
    extra = {"provider": spec.service, "app": app.pk}
    try:
        payload = spec.payload(app.payload_options)
    except ValueError as error:
        log.warning("registry.bad_payload_options", extra={"provider": spec.service})
        raise NotConfigured(f"{spec.code}_BAD_PAYLOAD_OPTIONS") from error
    try:
        values = records.values_of(app, spec.service)
    except CredentialKeyError as error:
        log.error("registry.credentials_unreadable", extra=extra)
        raise NotConfigured(f"{spec.code}_CREDENTIALS_UNREADABLE") from error
    if not spec.configured(values):
        raise NotConfigured(f"{spec.code}_NOT_CONFIGURED")
    current = conf.current()
    context = BuildContext(
        timeout=current.provider_timeout_seconds,
        payload=payload,
        setting=_setting,
        var_dir=current.var_dir,
    )
    try:
        return spec.build(values, context)
    except ValueError as error:
        log.warning("registry.bad_credentials", extra=extra)
        raise NotConfigured(f"{spec.code}_BAD_CREDENTIALS") from error


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
        loaded = App.objects.prefetch_related("credentials").in_bulk(missing)
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
            spec = BY_SERVICE.get(service)
            if spec is None:
                raise NotConfigured(f"{service.upper()}_NOT_SUPPORTED")
            if cached is not None:
                stale = _cache.pop(key)[1]
            provider = build(app, spec)
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
