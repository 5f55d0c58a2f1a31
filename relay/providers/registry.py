"""One provider instance per app, service and credentials version, reused across sends.

Credentials change in the admin: the cache key includes the app's `updated` time, so a worker
builds a fresh client on the next send and closes the old one, with no restart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime

from relay.models import App, Service
from relay.providers.base import PushProvider


class NotConfigured(Exception):
    """The app has no usable credentials for this provider."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _build_fcm(app: App) -> PushProvider:
    from relay.providers.fcm import FcmConfig, FcmProvider

    if not app.fcm_service_account:
        raise NotConfigured("FCM_NOT_CONFIGURED")
    try:
        config = FcmConfig.parse(app.fcm_service_account, app.fcm_endpoint)
    except ValueError as error:
        raise NotConfigured("FCM_BAD_CREDENTIALS") from error
    return FcmProvider(config)


BUILDERS: dict[str, Callable[[App], PushProvider]] = {
    Service.FCM: _build_fcm,
}

_lock = threading.Lock()
_cache: dict[tuple[int, str], tuple[datetime, PushProvider]] = {}


def provider_for(app: App, service: str) -> PushProvider:
    key = (app.pk, service)
    with _lock:
        cached = _cache.get(key)
        if cached is not None and cached[0] == app.updated:
            return cached[1]
        builder = BUILDERS.get(service)
        if builder is None:
            raise NotConfigured(f"{service.upper()}_NOT_SUPPORTED")
        provider = builder(app)
        _cache[key] = (app.updated, provider)
    if cached is not None:
        cached[1].close()
    return provider


def close_all() -> None:
    with _lock:
        providers = [provider for _, provider in _cache.values()]
        _cache.clear()
    for provider in providers:
        provider.close()
