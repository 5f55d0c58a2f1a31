"""Is a process able to do its job: the probes of web, gateway and worker (docs/production.md,
"Watching it"). Every check answers within a few seconds even when what it checks is gone."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from celery import current_app as celery_app
from django.core.cache import cache
from django.db import connection

from relay.services import throttling

CACHE_PROBE_KEY = "relay:readyz"


def database_reachable() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except Exception:
        # A dead connection stays dead: the next check opens a new one.
        with contextlib.suppress(Exception):
            connection.close()
        return False


def broker_reachable() -> bool:
    try:
        with celery_app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
        return True
    except Exception:
        return False


def cache_reachable() -> bool:
    """The API's rate-limit counters live in the cache (CACHE_URL)."""
    try:
        cache.set(CACHE_PROBE_KEY, "1", timeout=10)
        return cache.get(CACHE_PROBE_KEY) == "1"
    except Exception:
        return False


def readiness() -> dict[str, bool]:
    """The worker's: it reads registrations and takes sends from the broker."""
    return {"database": database_reachable(), "broker": broker_reachable()}


def web_readiness() -> dict[str, bool]:
    """The web process also needs the throttling store (UnifiedPush rate limits) and the
    cache (the API's rate limits)."""
    return {
        **readiness(),
        "throttling": throttling.reachable(),
        "cache": cache_reachable(),
    }


def gateway_readiness(links: Mapping[int, bool]) -> dict[str, bool]:
    """The gateway is ready when every enabled component's link is up (`links`: component id
    -> up), and it can check publishes (database) and queue them (broker)."""
    return {**readiness(), "links": all(links.values())}
