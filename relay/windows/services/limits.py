"""Rate limits per client address and per device, counted in the shared cache so that every
web process and the TLS listener count in the same place."""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import time
from collections.abc import Sequence
from typing import Any

import redis
from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache

from relay import conf
from relay.windows.services.errors import ErrorKind, UwpxError

log = logging.getLogger("relay.windows.services")


def _limit_key(scope: str, value: str) -> str:
    # Keyed hash: neither a device id nor a client address ever sits in the cache in clear.
    digest = hmac.new(settings.SECRET_KEY.encode(), value.encode(), hashlib.sha256).hexdigest()
    return f"uwpx-rl:{scope}:{digest[:32]}"


# Each counter: a fresh window starts at 0 with its expiry, then one more. One command for all
# the counters of a request, atomic, and a counter never lives without its expiry.
_COUNT_SCRIPT = """
local counts = {}
for i, key in ipairs(KEYS) do
  redis.call('SET', key, 0, 'EX', ARGV[i], 'NX')
  counts[i] = redis.call('INCR', key)
end
return counts
"""


@functools.lru_cache(maxsize=8)
def _redis_counter(location: str, options: tuple[tuple[str, Any], ...]) -> Any:
    """The counting script on a redis-py client of our own, on the server the default cache
    writes to (the first of its LOCATION, as Django's RedisCache writes) with its OPTIONS:
    Django's backend keeps its client private. One client (a connection pool, safe across
    threads and forks) per location, so a settings change gets a new one."""
    client = redis.Redis.from_url(location, **dict(options))
    return client.register_script(_COUNT_SCRIPT)


# Options Django's RedisCache takes for itself; the rest are redis-py's connection options.
_DJANGO_ONLY_OPTIONS = ("pool_class", "parser_class", "serializer")


def _writer_location(backend_settings: dict[str, Any]) -> str:
    location = backend_settings["LOCATION"]
    servers = location.split(",") if isinstance(location, str) else list(location)
    return str(servers[0])


def _count(keys: Sequence[tuple[str, int]]) -> list[int]:
    """Add one to each (key, timeout) counter and return the new counts.

    On Redis, one round trip (the script above). The keys and values are the ones Django's
    cache.add/incr use (same prefix, raw integers), so every process counts in the same place.
    Other backends (files, memory): cache.add, then cache.incr.
    """
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        backend_settings = settings.CACHES["default"]
        options = {
            name: value
            for name, value in backend_settings.get("OPTIONS", {}).items()
            if name not in _DJANGO_ONLY_OPTIONS
        }
        script = _redis_counter(_writer_location(backend_settings), tuple(sorted(options.items())))
        counts = script(
            keys=[backend.make_and_validate_key(key) for key, _ in keys],
            args=[timeout for _, timeout in keys],
        )
        return [int(value) for value in counts]
    counts = []
    for key, timeout in keys:
        backend.add(key, 0, timeout=timeout)
        try:
            counts.append(backend.incr(key))
        except ValueError:  # expired between add and incr
            backend.set(key, 1, timeout=timeout)
            counts.append(1)
    return counts


def _hit(*limits: tuple[str, str, Sequence[float]]) -> None:
    """Count one request in a fixed window of the shared cache for each (scope, value, rate);
    UwpxError when any of them is over its limit.

    Fails open when the cache is unreachable: the limits protect the service, they must not
    take registration down with them.
    """
    now = time.time()
    counted: list[tuple[str, int, float, int]] = []
    keys: list[tuple[str, int]] = []
    for scope, value, rate in limits:
        limit, seconds = int(rate[0]), float(rate[1])
        if limit <= 0 or seconds <= 0:
            continue
        window = int(now // seconds)
        counted.append((scope, limit, seconds, window))
        keys.append((f"{_limit_key(scope, value)}:{window}", int(seconds) + 1))
    if not keys:
        return
    try:
        hits = _count(keys)
    except Exception as error:  # any cache backend error: count nothing
        log.warning("uwpx.rate_limit_unavailable", extra={"error_type": type(error).__name__})
        return
    for (scope, limit, seconds, window), count in zip(counted, hits, strict=True):
        if count > limit:
            retry_after = max(1.0, (window + 1) * seconds - now)
            log.info("uwpx.rate_limited", extra={"scope": scope})
            raise UwpxError(
                ErrorKind.RATE_LIMITED,
                f"Too many requests; try again in {int(retry_after + 0.999)} seconds.",
                retry_after=retry_after,
            )


def check_address_rate(*, client_address: str) -> None:
    """Per client address; checked before a request body is even parsed."""
    _hit(("address", client_address, conf.current().uwpx_rate_limit_address))


def check_device_rate(*, device_id: str, action: str) -> None:
    """Per device id, with a tighter budget for test pushes (each one is a real WNS send)."""
    settings_ = conf.current()
    if action == "request_test_push":
        _hit(
            ("device", device_id, settings_.uwpx_rate_limit_device),
            ("test-push", device_id, settings_.uwpx_rate_limit_test_push),
        )
    else:
        _hit(("device", device_id, settings_.uwpx_rate_limit_device))
