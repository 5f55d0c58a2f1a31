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
  `result`: the pending send is already durably queued.

The same stores keep the token buckets that limit new registrations (`take_tokens`: one
token from several buckets, all or none, in one round trip; relay.services.registrations).

The state is advisory and fails open: when the store cannot be reached, a publish is admitted
and sent at once (a duplicate wake-up beats a lost one). A pending send that never ran (its
enqueue failed and the clean-up did too) stops absorbing publishes after a grace period.

Stores: `redis://` (several hosts; time comes from the Redis server, so hosts with skewed
clocks agree) or `sqlite:///path` (the embedded default: every process on one host; SQLite's
write lock makes each decision atomic across processes). Keys carry the registration's node
and the tenant's creation time, so state never leaks to a re-created row with a reused id.
"""

from __future__ import annotations

import enum
import logging
import os
import random
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from django.conf import settings

from relay.models import Registration, Tenant

log = logging.getLogger(__name__)

KEY_PREFIX = "relay:state:"
# A pending send whose due time is this far gone is presumed lost: stop folding into it.
GRACE_SECONDS = 60.0


class Decision(enum.Enum):
    SEND = "send"  # send now
    SCHEDULE = "schedule"  # queue one delayed send (this publish's push id) at the window's end
    FOLDED = "folded"  # folded into the pending delayed send
    LIMITED = "limited"  # the tenant is over its rate


@dataclass(frozen=True, slots=True)
class Fold:
    """What one publish brings to a (possibly coalesced) send."""

    important: bool
    message_count: int | None = None
    pending_subscription_count: int | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    decision: Decision
    delay: float = 0.0  # SCHEDULE: seconds until the window ends; LIMITED: until a token
    push_id: str = ""  # FOLDED: the pending send that carries this publish


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """One publish to decide in a batch (`admit_many`)."""

    tenant: Tenant
    registration: Registration
    push_id: str
    fold: Fold


@dataclass(frozen=True, slots=True)
class Taken:
    """The merged publishes a coalesced send carries."""

    important: bool
    message_count: int | None
    pending_subscription_count: int | None
    folded: int


@dataclass(frozen=True, slots=True)
class Limit:
    rate: float
    burst: int

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0


class StateUnavailable(Exception):
    """The store did not answer; callers fail open."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket for `take_tokens`, by its key (without KEY_PREFIX) and limit."""

    key: str
    limit: Limit


@dataclass(frozen=True, slots=True)
class Refusal:
    """`take_tokens` took nothing: `bucket` (its index) is empty for `retry_after` seconds."""

    bucket: int
    retry_after: float


@dataclass(frozen=True, slots=True)
class _Ask:
    bucket: str
    limit: Limit
    window_key: str
    window: float
    push_id: str
    fold: Fold


class _Store(Protocol):
    def admit(
        self, bucket: str, limit: Limit, window_key: str, window: float, push_id: str, fold: Fold
    ) -> Admission: ...

    def admit_many(self, asks: list[_Ask]) -> list[Admission]: ...

    def take(self, window_key: str, push_id: str, window: float) -> Taken | None: ...

    def abandon(self, window_key: str, push_id: str) -> None: ...

    def take_tokens(self, buckets: list[Bucket]) -> Refusal | None: ...

    def reset(self) -> None: ...

    def ping(self) -> None: ...


# --- keys and limits ---------------------------------------------------------------------------


def tenant_limit(tenant: Tenant) -> Limit:
    """The tenant's own rate and burst, else the defaults (RELAY TENANT_RATE_*)."""
    rate = tenant.rate_limit_per_second
    burst = tenant.rate_limit_burst
    if rate is None:
        rate = float(settings.RELAY["TENANT_RATE_PER_SECOND"])
    if burst is None:
        burst = int(settings.RELAY["TENANT_RATE_BURST"])
    return Limit(rate=float(rate), burst=max(1, int(burst)))


def bucket_key(tenant: Tenant) -> str:
    return f"tb:{tenant.pk}:{int(tenant.created.timestamp())}"


def window_key(registration: Registration) -> str:
    # The node is random per registration: a reused id (SQLite, a re-created test database)
    # never inherits an old window.
    return f"cw:{registration.pk}:{registration.node}"


def coalesce_window() -> float:
    return max(0.0, float(settings.RELAY["COALESCE_SECONDS"]))


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
    asks: list[_Ask] = []
    for index, request in enumerate(requests):
        limit = tenant_limit(request.tenant)
        if limit.unlimited and window <= 0:
            continue
        indexes.append(index)
        asks.append(
            _Ask(
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
    """The delayed send `push_id` could not be queued: later publishes must not fold into it."""
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


# --- Redis -------------------------------------------------------------------------------------

_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])
if rate > 0 then
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(b[1])
  local ts = tonumber(b[2])
  if tokens == nil or ts == nil then
    tokens = burst
    ts = now
  end
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
  local ttl = math.ceil((burst / rate + 60) * 1000)
  if tokens < 1 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
    redis.call('PEXPIRE', KEYS[1], ttl)
    return {'limited', tostring((1 - tokens) / rate)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[1], ttl)
end
if window <= 0 then
  return {'send', '0'}
end
local c = redis.call('HMGET', KEYS[2], 'last', 'pending', 'due')
local last = tonumber(c[1])
local pending = c[2]
local due = tonumber(c[3])
if pending and due and now < due + grace then
  if ARGV[6] == '1' then
    redis.call('HSET', KEYS[2], 'important', '1')
  end
  if ARGV[7] ~= '' then
    redis.call('HSET', KEYS[2], 'mc', ARGV[7])
  end
  if ARGV[8] ~= '' then
    redis.call('HSET', KEYS[2], 'psc', ARGV[8])
  end
  redis.call('HINCRBY', KEYS[2], 'folded', 1)
  return {'folded', pending}
end
if last and now - last < window then
  due = last + window
  redis.call('HSET', KEYS[2], 'pending', ARGV[5], 'due', tostring(due), 'important', ARGV[6],
             'mc', ARGV[7], 'psc', ARGV[8], 'folded', '0')
  redis.call('PEXPIRE', KEYS[2], math.ceil((due - now + grace) * 1000))
  return {'schedule', tostring(due - now)}
end
redis.call('HSET', KEYS[2], 'last', tostring(now))
redis.call('HDEL', KEYS[2], 'pending', 'due', 'important', 'mc', 'psc', 'folded')
redis.call('PEXPIRE', KEYS[2], math.ceil((window + grace) * 1000))
return {'send', '0'}
"""

_TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local c = redis.call('HMGET', KEYS[1], 'pending', 'important', 'mc', 'psc', 'folded', 'last')
local last = tonumber(c[6])
if last == nil or last < now then
  redis.call('HSET', KEYS[1], 'last', tostring(now))
end
local ttl = math.ceil((tonumber(ARGV[2]) + tonumber(ARGV[3])) * 1000)
if c[1] == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'pending', 'due', 'important', 'mc', 'psc', 'folded')
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {'1', c[2] or '0', c[3] or '', c[4] or '', c[5] or '0'}
end
if not c[1] then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {'0'}
"""

# KEYS: the buckets; ARGV: rate and burst of each, in order. Takes a token from every bucket,
# or from none when one is empty; answers {'-1', '0'} or {index (0-based), seconds to wait}.
_TAKE_TOKENS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tokens = {}
local empty = -1
local wait = 0
for i = 1, #KEYS do
  local rate = tonumber(ARGV[2 * i - 1])
  local burst = tonumber(ARGV[2 * i])
  local b = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local have = tonumber(b[1])
  local ts = tonumber(b[2])
  if have == nil or ts == nil then
    have = burst
    ts = now
  end
  have = math.min(burst, have + math.max(0, now - ts) * rate)
  tokens[i] = have
  if have < 1 and empty < 0 then
    empty = i - 1
    wait = (1 - have) / rate
  end
end
for i = 1, #KEYS do
  local rate = tonumber(ARGV[2 * i - 1])
  local burst = tonumber(ARGV[2 * i])
  local left = tokens[i]
  if empty < 0 then
    left = left - 1
  end
  redis.call('HSET', KEYS[i], 'tokens', tostring(left), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[i], math.ceil((burst / rate + 60) * 1000))
end
return {tostring(empty), tostring(wait)}
"""

_ABANDON_LUA = """
if redis.call('HGET', KEYS[1], 'pending') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'pending', 'due', 'important', 'mc', 'psc', 'folded')
end
return {'1'}
"""


def _count(value: int | None) -> str:
    return "" if value is None else str(int(value))


def _parse_count(value: Any) -> int | None:
    if value in (None, "", b""):
        return None
    return int(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _admit_call(ask: _Ask) -> tuple[list[str], list[Any]]:
    keys = [KEY_PREFIX + ask.bucket, KEY_PREFIX + ask.window_key]
    args = [
        repr(max(0.0, ask.limit.rate)),
        ask.limit.burst,
        repr(ask.window),
        repr(GRACE_SECONDS),
        ask.push_id,
        "1" if ask.fold.important else "0",
        _count(ask.fold.message_count),
        _count(ask.fold.pending_subscription_count),
    ]
    return keys, args


def _admission(answer: list[str]) -> Admission:
    decision = Decision(answer[0])
    if decision is Decision.FOLDED:
        return Admission(decision, push_id=answer[1])
    return Admission(decision, delay=max(0.0, float(answer[1])))


class _RedisStore:
    def __init__(self, url: str) -> None:
        import redis

        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url, socket_timeout=0.5, socket_connect_timeout=0.5, health_check_interval=30
        )
        self._admit = self._client.register_script(_ADMIT_LUA)
        self._take = self._client.register_script(_TAKE_LUA)
        self._abandon = self._client.register_script(_ABANDON_LUA)
        self._take_tokens = self._client.register_script(_TAKE_TOKENS_LUA)

    def _run(self, script: Any, keys: list[str], args: list[Any]) -> list[str]:
        try:
            return [_text(item) for item in script(keys=keys, args=args)]
        except self._errors as error:
            raise StateUnavailable(type(error).__name__) from error

    def admit(
        self, bucket: str, limit: Limit, window_key: str, window: float, push_id: str, fold: Fold
    ) -> Admission:
        ask = _Ask(bucket, limit, window_key, window, push_id, fold)
        keys, args = _admit_call(ask)
        return _admission(self._run(self._admit, keys, args))

    def admit_many(self, asks: list[_Ask]) -> list[Admission]:
        """One pipeline of the admit script: one round trip (plus SCRIPT EXISTS) per batch."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for ask in asks:
                keys, args = _admit_call(ask)
                self._admit(keys=keys, args=args, client=pipe)
            answers = pipe.execute()
        except self._errors as error:
            raise StateUnavailable(type(error).__name__) from error
        return [_admission([_text(item) for item in answer]) for answer in answers]

    def take(self, window_key: str, push_id: str, window: float) -> Taken | None:
        answer = self._run(
            self._take, [KEY_PREFIX + window_key], [push_id, repr(window), repr(GRACE_SECONDS)]
        )
        if answer[0] != "1":
            return None
        return Taken(
            important=answer[1] == "1",
            message_count=_parse_count(answer[2]),
            pending_subscription_count=_parse_count(answer[3]),
            folded=int(answer[4] or 0),
        )

    def abandon(self, window_key: str, push_id: str) -> None:
        self._run(self._abandon, [KEY_PREFIX + window_key], [push_id])

    def take_tokens(self, buckets: list[Bucket]) -> Refusal | None:
        args: list[Any] = []
        for bucket in buckets:
            args += [repr(bucket.limit.rate), bucket.limit.burst]
        answer = self._run(self._take_tokens, [KEY_PREFIX + b.key for b in buckets], args)
        index = int(answer[0])
        return None if index < 0 else Refusal(index, max(0.0, float(answer[1])))

    def ping(self) -> None:
        try:
            self._client.ping()
        except self._errors as error:
            raise StateUnavailable(type(error).__name__) from error

    def reset(self) -> None:
        try:
            keys = list(self._client.scan_iter(match=KEY_PREFIX + "*", count=1000))
            if keys:
                self._client.delete(*keys)
        except self._errors as error:
            raise StateUnavailable(type(error).__name__) from error


# --- SQLite (one host) -------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets (
    key TEXT PRIMARY KEY, tokens REAL NOT NULL, ts REAL NOT NULL, expires REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS windows (
    key TEXT PRIMARY KEY, last REAL, pending TEXT, due REAL, important INTEGER,
    mc INTEGER, psc INTEGER, folded INTEGER, expires REAL NOT NULL
);
"""


_FRESH_WINDOW = "INSERT OR REPLACE INTO windows VALUES (?, ?, NULL, NULL, NULL, NULL, NULL, 0, ?)"


class _SqliteStore:
    """The same decisions as the Lua scripts, each in one `BEGIN IMMEDIATE` transaction."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        try:
            self._connection().executescript(_SCHEMA)
        except sqlite3.Error as error:
            raise StateUnavailable(type(error).__name__) from error

    def _connection(self) -> sqlite3.Connection:
        pid, conn = getattr(self._local, "conn", (None, None))
        if conn is None or pid != os.getpid():
            conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = (os.getpid(), conn)
        return conn

    def _transaction(self) -> _Transaction:
        try:
            return _Transaction(self._connection())
        except sqlite3.Error as error:
            raise StateUnavailable(type(error).__name__) from error

    def admit(
        self, bucket: str, limit: Limit, window_key: str, window: float, push_id: str, fold: Fold
    ) -> Admission:
        with self._transaction() as conn:
            now = time.time()
            if random.random() < 0.001:
                conn.execute("DELETE FROM buckets WHERE expires < ?", (now,))
                conn.execute("DELETE FROM windows WHERE expires < ?", (now,))
            if not limit.unlimited:
                row = conn.execute(
                    "SELECT tokens, ts FROM buckets WHERE key = ? AND expires >= ?", (bucket, now)
                ).fetchone()
                tokens, ts = (float(limit.burst), now) if row is None else row
                tokens = min(limit.burst, tokens + max(0.0, now - ts) * limit.rate)
                allowed = tokens >= 1
                expires = now + limit.burst / limit.rate + 60
                conn.execute(
                    "INSERT OR REPLACE INTO buckets VALUES (?, ?, ?, ?)",
                    (bucket, tokens - 1 if allowed else tokens, now, expires),
                )
                if not allowed:
                    return Admission(Decision.LIMITED, delay=(1 - tokens) / limit.rate)
            if window <= 0:
                return Admission(Decision.SEND)
            row = conn.execute(
                "SELECT last, pending, due FROM windows WHERE key = ? AND expires >= ?",
                (window_key, now),
            ).fetchone()
            last, pending, due = row if row is not None else (None, None, None)
            if pending and due is not None and now < due + GRACE_SECONDS:
                conn.execute(
                    "UPDATE windows SET important = MAX(important, ?), mc = COALESCE(?, mc),"
                    " psc = COALESCE(?, psc), folded = folded + 1 WHERE key = ?",
                    (
                        int(fold.important),
                        fold.message_count,
                        fold.pending_subscription_count,
                        window_key,
                    ),
                )
                return Admission(Decision.FOLDED, push_id=pending)
            if last is not None and now - last < window:
                due = last + window
                conn.execute(
                    "INSERT OR REPLACE INTO windows VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?)",
                    (
                        window_key,
                        last,
                        push_id,
                        due,
                        int(fold.important),
                        fold.message_count,
                        fold.pending_subscription_count,
                        due + GRACE_SECONDS,
                    ),
                )
                return Admission(Decision.SCHEDULE, delay=due - now)
            conn.execute(_FRESH_WINDOW, (window_key, now, now + window + GRACE_SECONDS))
            return Admission(Decision.SEND)

    def admit_many(self, asks: list[_Ask]) -> list[Admission]:
        """One host: a transaction per decision is cheap, and keeps each one atomic."""
        return [
            self.admit(a.bucket, a.limit, a.window_key, a.window, a.push_id, a.fold) for a in asks
        ]

    def take(self, window_key: str, push_id: str, window: float) -> Taken | None:
        with self._transaction() as conn:
            now = time.time()
            row = conn.execute(
                "SELECT last, pending, important, mc, psc, folded, expires FROM windows"
                " WHERE key = ? AND expires >= ?",
                (window_key, now),
            ).fetchone()
            if row is None:
                conn.execute(_FRESH_WINDOW, (window_key, now, now + window + GRACE_SECONDS))
                return None
            last, pending, important, mc, psc, folded, expires = row
            last = now if last is None or last < now else last
            if pending != push_id:
                conn.execute("UPDATE windows SET last = ? WHERE key = ?", (last, window_key))
                return None
            conn.execute(
                "UPDATE windows SET last = ?, pending = NULL, due = NULL, important = NULL,"
                " mc = NULL, psc = NULL, folded = 0, expires = ? WHERE key = ?",
                (last, max(expires, now + window + GRACE_SECONDS), window_key),
            )
            return Taken(bool(important), mc, psc, int(folded or 0))

    def abandon(self, window_key: str, push_id: str) -> None:
        with self._transaction() as conn:
            conn.execute(
                "UPDATE windows SET pending = NULL, due = NULL, important = NULL, mc = NULL,"
                " psc = NULL, folded = 0 WHERE key = ? AND pending = ?",
                (window_key, push_id),
            )

    def take_tokens(self, buckets: list[Bucket]) -> Refusal | None:
        with self._transaction() as conn:
            now = time.time()
            if random.random() < 0.001:
                conn.execute("DELETE FROM buckets WHERE expires < ?", (now,))
            tokens: list[float] = []
            refusal: Refusal | None = None
            for index, bucket in enumerate(buckets):
                limit = bucket.limit
                row = conn.execute(
                    "SELECT tokens, ts FROM buckets WHERE key = ? AND expires >= ?",
                    (bucket.key, now),
                ).fetchone()
                have, ts = (float(limit.burst), now) if row is None else row
                have = min(limit.burst, have + max(0.0, now - ts) * limit.rate)
                tokens.append(have)
                if have < 1 and refusal is None:
                    refusal = Refusal(index, (1 - have) / limit.rate)
            for bucket, have in zip(buckets, tokens, strict=True):
                conn.execute(
                    "INSERT OR REPLACE INTO buckets VALUES (?, ?, ?, ?)",
                    (
                        bucket.key,
                        have if refusal else have - 1,
                        now,
                        now + bucket.limit.burst / bucket.limit.rate + 60,
                    ),
                )
            return refusal

    def ping(self) -> None:
        try:
            self._connection().execute("SELECT 1 FROM buckets LIMIT 1").fetchall()
        except sqlite3.Error as error:
            raise StateUnavailable(type(error).__name__) from error

    def reset(self) -> None:
        with self._transaction() as conn:
            conn.execute("DELETE FROM buckets")
            conn.execute("DELETE FROM windows")


class _Transaction:
    """`BEGIN IMMEDIATE` takes SQLite's write lock first, so read-then-write is atomic."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as error:
            raise StateUnavailable(type(error).__name__) from error
        return self.conn

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        try:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
        except sqlite3.Error as error:
            if exc_type is None:
                raise StateUnavailable(type(error).__name__) from error


# --- the store of this process ----------------------------------------------------------------

_lock = threading.Lock()
_stores: dict[tuple[int, str], _Store] = {}


def _store() -> _Store:
    url = settings.RELAY["STATE_URL"]
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


def _open(url: str) -> _Store:
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        return _RedisStore(url)
    if scheme == "sqlite":
        # sqlite:///relative/path or sqlite:////absolute/path, as SQLAlchemy spells them.
        return _SqliteStore(url.removeprefix("sqlite:///"))
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
    "reachable",
    "reset",
    "take",
    "take_tokens",
    "tenant_limit",
]
