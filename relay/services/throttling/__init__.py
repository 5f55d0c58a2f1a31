"""Burst coalescing per registration and a token bucket per tenant, shared by every process.

Both are decided in ONE round trip per publish (a Lua script in Redis, or one SQLite
transaction on a single host), so the gateway's hot path stays cheap:

- Token bucket: a tenant may publish `burst` times at once and `rate` times per second after
  that; excess publishes are answered with a `wait` error (docs/protocols.md 1.3), never dropped
  silently. A rate of 0 or less means no limit.
- Coalescing: a phone needs one wake-up, not fifty. At most one send per registration per
  window (RELAY["COALESCE_SECONDS"]). A publish inside the window schedules ONE delayed send at
  the window's end; further publishes fold into it. The delayed send carries the latest
  message counts, and is important if ANY folded publish was (a later silent publish never
  downgrades an important one: the user would miss the alert). Folded publishes are answered
  `result`: the pending send is already durably kept (a deferred send in the database,
  relay/services/deferred.py, queued by the workers' sweep at the window's end).

The same stores keep the token buckets that limit new registrations (`take_tokens`: one
token from several buckets, all or none, in one round trip; relay.services.registrations).

The state is advisory and fails open: when the store cannot be reached, a publish is admitted
and sent at once (a duplicate wake-up beats a lost one). A pending send that never ran (its
enqueue failed and the clean-up did too) stops absorbing publishes after a grace period.

Stores: `redis://` (several hosts; time comes from the Redis server, so hosts with skewed
clocks agree) or `sqlite:///path` (the embedded default: every process on one host; SQLite's
write lock makes each decision atomic across processes). Keys carry the registration's node
and the tenant's creation time, so state never leaks to a re-created row with a reused id.

This module is the API callers use and picks the store of this process; `decisions` holds the
types both stores share, `redis_store` the Lua scripts, `sqlite_store` the one-host store.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from relay import conf
from relay.models import Registration, Tenant
from relay.services.throttling.decisions import (
    Admission,
    Ask,
    Bucket,
    Decision,
    Fold,
    Limit,
    Refusal,
    StateUnavailable,
    Store,
    Taken,
)
from relay.services.throttling.redis_store import RedisStore
from relay.services.throttling.sqlite_store import SqliteStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """One publish to decide in a batch (`admit_many`)."""

    tenant: Tenant
    registration: Registration
    push_id: str
    fold: Fold


# --- keys and limits ---------------------------------------------------------------------------


def tenant_limit(tenant: Tenant) -> Limit:
    """The tenant's own rate and burst, else the defaults (RELAY TENANT_RATE_*)."""
    rate = tenant.rate_limit_per_second
    burst = tenant.rate_limit_burst
    if rate is None:
        rate = conf.current().tenant_rate_per_second
    if burst is None:
        burst = conf.current().tenant_rate_burst
    return Limit(rate=float(rate), burst=max(1, int(burst)))


def bucket_key(tenant: Tenant) -> str:
    return f"tb:{tenant.pk}:{int(tenant.created.timestamp())}"


def window_key(registration: Registration) -> str:
    # The node is random per registration: a reused id (SQLite, a re-created test database)
    # never inherits an old window.
    return f"cw:{registration.pk}:{registration.node}"


def coalesce_window() -> float:
    return max(0.0, conf.current().coalesce_seconds)


# --- what callers use --------------------------------------------------------------------------


# After the store failed, skip it for this long: a publish must not wait for a timeout each.
SKIP_AFTER_FAILURE_SECONDS = 5.0
_down_until = 0.0


def _available() -> bool:
    return time.monotonic() >= _down_until


def _failed(error: StateUnavailable) -> None:
    global _down_until
    _down_until = time.monotonic() + SKIP_AFTER_FAILURE_SECONDS
    log.warning("throttling.state_unavailable", extra={"error_type": str(error)})


def admit(*, tenant: Tenant, registration: Registration, push_id: str, fold: Fold) -> Admission:
    """Take a token from the tenant's bucket and decide whether this publish sends now."""
    limit = tenant_limit(tenant)
    window = coalesce_window()
    if (limit.unlimited and window <= 0) or not _available():
        return Admission(Decision.SEND)
    try:
        return _store().admit(
            bucket_key(tenant), limit, window_key(registration), window, push_id, fold
        )
    except StateUnavailable as error:
        _failed(error)
        return Admission(Decision.SEND)


def admit_many(*, requests: list[AdmitRequest]) -> list[Admission]:
    """`admit` for a batch of publishes in ONE round trip, decided in list order (as if one
    after another: a second publish for the same registration folds into the first)."""
    window = coalesce_window()
    admissions: list[Admission] = [Admission(Decision.SEND)] * len(requests)
    indexes: list[int] = []
    asks: list[Ask] = []
    for index, request in enumerate(requests):
        limit = tenant_limit(request.tenant)
        if limit.unlimited and window <= 0:
            continue
        indexes.append(index)
        asks.append(
            Ask(
                bucket_key(request.tenant),
                limit,
                window_key(request.registration),
                window,
                request.push_id,
                request.fold,
            )
        )
    if not asks or not _available():
        return admissions
    try:
        answers = _store().admit_many(asks)
    except StateUnavailable as error:
        _failed(error)
        return admissions
    for index, admission in zip(indexes, answers, strict=True):
        admissions[index] = admission
    return admissions


def take(*, registration: Registration, push_id: str) -> Taken | None:
    """Claim what was folded into the coalesced send `push_id`; None if nothing (any more)."""
    if not _available():
        return None
    try:
        return _store().take(window_key(registration), push_id, coalesce_window())
    except StateUnavailable as error:
        _failed(error)
        return None


def abandon(*, registration: Registration, push_id: str) -> None:
    """The delayed send `push_id` could not be kept: later publishes must not fold into it."""
    try:
        _store().abandon(window_key(registration), push_id)
    except StateUnavailable as error:
        _failed(error)


def take_tokens(buckets: list[Bucket]) -> Refusal | None:
    """Take one token from each bucket, or none when any of them is empty: one round trip,
    atomic across processes. Unlimited buckets are skipped; when the store cannot be reached
    this admits (fails open, as publishes do). None when taken."""
    limited = [(index, b) for index, b in enumerate(buckets) if not b.limit.unlimited]
    if not limited or not _available():
        return None
    try:
        refusal = _store().take_tokens([bucket for _, bucket in limited])
    except StateUnavailable as error:
        _failed(error)
        return None
    if refusal is None:
        return None
    return Refusal(limited[refusal.bucket][0], refusal.retry_after)


def reachable() -> bool:
    """Whether the throttling store answers now (readiness; publishes fail open without it)."""
    try:
        _store().ping()
        return True
    except StateUnavailable:
        return False


def reset() -> None:
    """Forget every window and bucket (tests, or an operator starting afresh)."""
    global _down_until
    _down_until = 0.0
    _store().reset()


# --- the store of this process ----------------------------------------------------------------

_lock = threading.Lock()
_stores: dict[tuple[int, str], Store] = {}


def _store() -> Store:
    url = conf.current().state_url
    key = (os.getpid(), url)
    store = _stores.get(key)
    if store is not None:
        return store
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = _open(url)
            _stores[key] = store
        return store


def check_store(url: str | None = None) -> None:
    """Open the state store afresh and ask it one question: raises ValueError for a URL no
    store understands, StateUnavailable when it does not answer (the deploy check, so a
    wrong RELAY_STATE_URL shows at start, not as fail-open publishes)."""
    _open(url or conf.current().state_url).ping()


def _open(url: str) -> Store:
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        return RedisStore(url)
    if scheme == "sqlite":
        # sqlite:///relative/path or sqlite:////absolute/path, as SQLAlchemy spells them.
        return SqliteStore(url.removeprefix("sqlite:///"))
    raise ValueError(f"RELAY_STATE_URL must be redis://... or sqlite:///path, not {scheme}://")


__all__ = [
    "Admission",
    "AdmitRequest",
    "Bucket",
    "Decision",
    "Fold",
    "Limit",
    "Refusal",
    "StateUnavailable",
    "Taken",
    "abandon",
    "admit",
    "admit_many",
    "check_store",
    "reachable",
    "reset",
    "take",
    "take_tokens",
    "tenant_limit",
]
