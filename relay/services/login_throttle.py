"""Failed admin logins are counted per username and per client address in the cache.

After `LOGIN_MAX_FAILURES` failures for one username (or ten times that from one address)
within `LOGIN_LOCKOUT_SECONDS`, further attempts are refused before the password is even
checked, until the window ends. A successful login clears its username's count. With several
web processes the cache must be shared (Redis) for the limits to be exact.
"""

from __future__ import annotations

import hashlib
import logging

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest

log = logging.getLogger(__name__)


def _limits() -> tuple[int, int, int]:
    relay = settings.RELAY
    per_user = int(relay.get("LOGIN_MAX_FAILURES", 5))
    per_address = int(relay.get("LOGIN_MAX_FAILURES_PER_ADDRESS", per_user * 10))
    window = int(relay.get("LOGIN_LOCKOUT_SECONDS", 900))
    return per_user, per_address, window


def _key(kind: str, value: str) -> str:
    # Hashed: cache keys must be short and safe, and nobody needs the username in Redis.
    return f"relay:login-failures:{kind}:{hashlib.sha256(value.encode()).hexdigest()[:32]}"


def client_address(request: HttpRequest) -> str:
    """REMOTE_ADDR, or the proxy's view of the client when the proxy is trusted to say it."""
    if settings.RELAY.get("TRUST_X_FORWARDED_FOR"):
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
        if forwarded:
            return forwarded.split(",")[-1].strip()
    return str(request.META.get("REMOTE_ADDR", ""))


def _keys(*, username: str, address: str) -> tuple[str, str]:
    return _key("user", username.strip().lower()), _key("address", address)


def is_locked(*, username: str, address: str) -> bool:
    per_user, per_address, _ = _limits()
    user_key, address_key = _keys(username=username, address=address)
    counts = cache.get_many([user_key, address_key])
    return counts.get(user_key, 0) >= per_user or counts.get(address_key, 0) >= per_address


def record_failure(*, username: str, address: str) -> None:
    _, _, window = _limits()
    for key in _keys(username=username, address=address):
        # add() starts the window only once; incr() is atomic in Redis and the local cache.
        cache.add(key, 0, timeout=window)
        try:
            cache.incr(key)
        except ValueError:  # expired between add() and incr()
            cache.set(key, 1, timeout=window)
    log.info("admin.login_failed")


def record_success(*, username: str, address: str) -> None:
    user_key, _ = _keys(username=username, address=address)
    cache.delete(user_key)
