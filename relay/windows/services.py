"""The UWPX-style registration protocol of Windows clients (docs/protocols.md section 3).

Both entry points, the HTTP API (`relay.windows.api`) and the TLS listener
(`run_uwpx_listener`), call these functions: they validate, store and queue, and raise
`UwpxError` carrying the text the client is shown. The device id is the client's only
capability, so only its SHA-256 is stored, a device is found by that hash (a timing difference
in the index lookup cannot reveal the id) and the final equality checks use
`hmac.compare_digest`. Nothing here logs a device id, a channel URI, a JID, a node or a secret.

Accounts are named by a bare JID (the documented protocol) or, as the shipped UWPX client
does, by its account id, `sha256_hex(device_id + bare_jid)`. An account named by its id has no
known domain until its server first publishes: `relay.services.publishing` binds the
registration to that publishing domain then (node and secret are still required).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any, TypeVar

from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache
from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connection,
    transaction,
)
from django.utils import timezone
from slixmpp.jid import JID, InvalidJID

from relay import conf
from relay.identifiers import new_node, new_secret
from relay.models import App, Component, Registration, Service, Tenant, WnsDevice
from relay.services import channels, lifecycle, queue, test_push
from relay.services.groupcommit import GroupCommit

log = logging.getLogger(__name__)

DEVICE_ID_PATTERN = r"^[0-9a-fA-F]{32,128}$"
ACCOUNT_ID_PATTERN = r"^[0-9a-fA-F]{64}$"
APP_KEY_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_CHANNEL_URI_LENGTH = channels.MAX_CHANNEL_URI_LENGTH
# RFC 7622: local part, domain part and resource up to 1023 bytes each.
MAX_BARE_JID_LENGTH = 2047

_DEVICE_ID = re.compile(DEVICE_ID_PATTERN)
_ACCOUNT_ID = re.compile(ACCOUNT_ID_PATTERN)
_APP_KEY = re.compile(APP_KEY_PATTERN)

DEVICE_ID_RULE = "device_id must be 32 to 128 hexadecimal characters (UWPX sends 64)."
UNKNOWN_DEVICE = "Device id unknown."


class ErrorKind(enum.Enum):
    """Why a request failed; the entry points map it to an HTTP status (or just the text)."""

    MALFORMED = "malformed"  # not JSON at all
    INVALID = "invalid"  # JSON, but not a valid message
    TOO_LARGE = "too_large"
    UNKNOWN_APP = "unknown_app"
    UNKNOWN_DEVICE = "unknown_device"
    CONFLICT = "conflict"  # valid, but not possible in the device's current state
    RATE_LIMITED = "rate_limited"
    UNAVAILABLE = "unavailable"  # passing trouble on our side: try again later


class UwpxError(Exception):
    """A refusal with the clear text of the UWPX error response."""

    def __init__(self, kind: ErrorKind, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class AccountRef:
    """One account as the client names it: exactly one of the two is set."""

    bare_jid: str = ""
    account_id: str = ""


@dataclass(frozen=True, slots=True)
class AccountAnswer:
    bare_jid: str  # "" when the client named the account by its id
    account_id: str  # sha256_hex(device_id + bare_jid): the account_id of every WNS push
    node: str
    secret: str


@dataclass(frozen=True, slots=True)
class AccountsAnswer:
    push_bare_jid: str
    accounts: list[AccountAnswer]


@dataclass(frozen=True, slots=True)
class _Wanted:
    ref: AccountRef
    device_hash: str
    domain: str  # "" when named by account id
    index: int  # first position in the client's list, for error messages


# --- identifiers and validation ---------------------------------------------------------------


def device_id_hash(device_id: str) -> str:
    """What is stored of a device id (WnsDevice.device_id_hash)."""
    return hashlib.sha256(device_id.encode()).hexdigest()


def account_id(*, device_id: str, bare_jid: str) -> str:
    """sha256_hex(device_id + bare_jid), as UWPX computes it (docs/protocols.md 3.2).

    The JID is hashed exactly as the client sent it: the client recomputes this value from its
    own spelling to know which account a push is for.
    """
    return hashlib.sha256(f"{device_id}{bare_jid}".encode()).hexdigest()


def validate_device_id(device_id: object) -> str:
    if not isinstance(device_id, str) or not _DEVICE_ID.fullmatch(device_id):
        raise UwpxError(ErrorKind.INVALID, DEVICE_ID_RULE)
    return device_id


def bare_jid_domain(bare_jid: object, *, field: str = "bare_jid") -> str:
    """Parse an account's bare JID (RFC 7622, via slixmpp) and return its normalized domain."""
    if not isinstance(bare_jid, str) or not bare_jid:
        raise UwpxError(ErrorKind.INVALID, f"{field} must be a non-empty string.")
    if len(bare_jid.encode()) > MAX_BARE_JID_LENGTH:
        raise UwpxError(ErrorKind.INVALID, f"{field} is longer than a JID can be.")
    try:
        jid = JID(bare_jid)
    except InvalidJID as error:
        raise UwpxError(ErrorKind.INVALID, f"{field} is not a valid JID: {error}.") from None
    except ValueError:  # e.g. a UnicodeError deep in IDNA: still the client's input
        raise UwpxError(ErrorKind.INVALID, f"{field} is not a valid JID.") from None
    if jid.resource:
        raise UwpxError(ErrorKind.INVALID, f"{field} must be a bare JID, without a /resource.")
    if not jid.user:
        raise UwpxError(ErrorKind.INVALID, f"{field} must be an account's JID (name@domain).")
    return str(jid.domain)


def validate_channel_uri(*, app: App, channel_uri: object) -> str:
    """Refuse a channel the worker could never send to (relay.services.channels)."""
    if not isinstance(channel_uri, str) or not channels.wns_channel_sendable(
        app=app, channel_uri=channel_uri
    ):
        reason = channels.why_not_sendable(app=app, channel_uri=channel_uri)
        raise UwpxError(ErrorKind.INVALID, f"channel_uri: {reason}")
    return channel_uri


def _resolve_accounts(*, device_id: str, accounts: Sequence[AccountRef]) -> list[_Wanted]:
    """Validate the list; the same account named twice counts once (first position wins)."""
    limit = conf.current().uwpx_max_accounts
    if len(accounts) > limit:
        raise UwpxError(ErrorKind.INVALID, f"accounts: at most {limit} accounts per device.")
    wanted: dict[str, _Wanted] = {}
    for index, ref in enumerate(accounts):
        field = f"accounts[{index}]"
        if bool(ref.bare_jid) == bool(ref.account_id):
            raise UwpxError(ErrorKind.INVALID, f"{field} needs either bare_jid or account_id.")
        if ref.bare_jid:
            domain = bare_jid_domain(ref.bare_jid, field=f"{field}.bare_jid")
            digest = account_id(device_id=device_id, bare_jid=ref.bare_jid)
        else:
            if not _ACCOUNT_ID.fullmatch(ref.account_id):
                raise UwpxError(
                    ErrorKind.INVALID, f"{field}.account_id must be 64 hexadecimal characters."
                )
            domain, digest = "", ref.account_id
        wanted.setdefault(digest, _Wanted(ref, digest, domain, index))
    return list(wanted.values())


# --- rate limits --------------------------------------------------------------------------------


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


def _redis_counter(backend: RedisCache) -> Any:
    """The counting script on one client per cache backend object (Django's cache builds a
    client per call: add and incr made two per request, and a round trip each).

    Backends are per thread (django.core.cache.caches), and so is what is kept on them; a
    settings change makes new backends, and so new clients."""
    script = getattr(backend, "_uwpx_counter", None)
    if script is None:
        script = backend._cache.get_client(write=True).register_script(_COUNT_SCRIPT)
        backend._uwpx_counter = script  # type: ignore[attr-defined]
    return script


def _count(keys: Sequence[tuple[str, int]]) -> list[int]:
    """Add one to each (key, timeout) counter and return the new counts.

    On Redis, one round trip (the script above). The keys and values are the ones Django's
    cache.add/incr use (same prefix, raw integers), so every process counts in the same place.
    Other backends (files, memory): cache.add, then cache.incr.
    """
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        script = _redis_counter(backend)
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


# --- lookups ------------------------------------------------------------------------------------


def app_for_key(*, public_key: str) -> App:
    """The app named in the URL (or configured for the listener); refuses a suspended tenant.

    Kept per process once found: every request named its app and read it again, a round trip
    of its own. The actions' first statement checks that the app is still as kept (`_CURRENT`:
    same row, channel hosts, tenant not suspended) and read it afresh when not
    (`_app_changed`), so a suspension or a new host list counts from the next request on, as
    before. Only apps that exist are kept: no one can fill the memory with made-up keys."""
    app = _apps.get(public_key) if isinstance(public_key, str) else None
    return app if app is not None else _load_app(public_key)


_apps: dict[str, App] = {}


def _load_app(public_key: str) -> App:
    """One plain statement (the ORM's query building cost more than the query; credentials
    are not read: each one would be decrypted)."""
    if isinstance(public_key, str):
        _apps.pop(public_key, None)
    row = None
    if isinstance(public_key, str) and _APP_KEY.fullmatch(public_key):
        row = _fetchone(_APP_SQL, [public_key])
    if row is None:
        raise UwpxError(ErrorKind.UNKNOWN_APP, "Unknown app key.")
    if row[4]:
        raise UwpxError(ErrorKind.UNAVAILABLE, "This push service is suspended; try again later.")
    app = App.from_db(connection.alias, list(_APP_FIELDS), list(row[:4]))
    _apps[public_key] = app
    return app


def _app_params(app: App) -> list[object]:
    return [app.pk, app.tenant_id, app.public_key, app.wns_channel_hosts]


def _app_changed(app: App) -> App | None:
    """After a statement guarded by `_CURRENT` found nothing: the app as it is now when it
    changed (UwpxError when it is gone or suspended), None when it is as kept (so the row
    itself was missing)."""
    fresh = _load_app(app.public_key)
    return None if _app_params(fresh) == _app_params(app) else fresh


class _AppChanged(Exception):
    """The kept app no longer matches its row: the request runs again with the fresh one."""

    def __init__(self, app: App) -> None:
        super().__init__("app changed")
        self.app = app


T = TypeVar("T")


def _on_live_connection(action: Callable[[], T]) -> T:
    """Run `action` (a whole transaction, or statements each committed on its own), once
    more on a new connection when the kept one turns out dead at the request's first use.

    Django checks a kept connection with a `SELECT 1` before each request's first statement
    (CONN_HEALTH_CHECKS): a round trip per request for a connection that is nearly always
    alive. Here the request's own first statement is the check, and a connection found dead
    (the server restarted, a proxy dropped it) is replaced and the action run again, which is
    safe: nothing of a dead connection's open transaction was committed, and the actions are
    idempotent (a lost commit's answer is read back by the second run). A failure on a fresh
    or already used connection is the database's trouble and is raised as before."""
    wrapper: Any = connection  # Django's health-check flags are not in its stubs
    unchecked = (
        wrapper.connection is not None
        and wrapper.health_check_enabled
        and not wrapper.health_check_done
    )
    if not unchecked:
        return action()
    wrapper.health_check_done = True
    kept = connection.connection  # Django may have opened another by the time it raises
    try:
        return action()
    except (OperationalError, InterfaceError):
        # psycopg's connection says whether it died; SQLite's has no such state: raise.
        if not getattr(kept, "closed", False) and not getattr(kept, "broken", False):
            raise
        connection.close()
        log.info("uwpx.database_reconnected")
        return action()


def push_component(*, app: App) -> Component | None:
    """The component a Windows client enables push with: the app's first enabled one by id."""
    return Component.objects.filter(app=app, enabled=True).order_by("id").first()


def _device(*, app: App, device_id: str, for_update: bool = False) -> WnsDevice:
    digest = device_id_hash(device_id)
    devices = WnsDevice.objects.filter(app=app, device_id_hash=digest)
    if for_update:
        devices = devices.select_for_update()
    device = devices.first()
    if device is None or not hmac.compare_digest(device.device_id_hash, digest):
        raise UwpxError(ErrorKind.UNKNOWN_DEVICE, UNKNOWN_DEVICE)
    return device


# --- plain SQL for the two hot requests ------------------------------------------------------
# set_channel_uri and set_accounts run for every Windows client start. Written with the ORM
# they cost about a dozen statements, each built anew (several ms of CPU on a loaded
# machine); here they are a few fixed statements that both PostgreSQL and SQLite run
# (RETURNING and ON CONFLICT: SQLite 3.35+). The rarer changes (accounts removed, a token
# renewed, a domain learnt) still go through the ORM and relay.services.lifecycle.

_APP_FIELDS = ("id", "tenant_id", "public_key", "wns_channel_hosts")
_APP_SQL = (
    f"SELECT a.id, a.tenant_id, a.public_key, a.wns_channel_hosts, t.suspended"
    f" FROM {App._meta.db_table} a JOIN {Tenant._meta.db_table} t ON t.id = a.tenant_id"
    f" WHERE a.public_key = %s"
)
_DEVICES = WnsDevice._meta.db_table
_REGISTRATIONS = Registration._meta.db_table
_COMPONENTS = Component._meta.db_table
# The app kept by app_for_key is still its row as it is: id, tenant, key, channel hosts, and
# its tenant not suspended (params: _app_params). Part of each action's first statement.
_CURRENT = (
    f"EXISTS (SELECT 1 FROM {App._meta.db_table} ca JOIN {Tenant._meta.db_table} ct"
    f" ON ct.id = ca.tenant_id WHERE ca.id = %s AND ca.tenant_id = %s AND ca.public_key = %s"
    f" AND ca.wns_channel_hosts = %s AND NOT ct.suspended)"
)
# Creates the device unless it exists or the app changed (then nothing: no row returned).
_NEW_DEVICE_SQL = (
    f"INSERT INTO {_DEVICES} (app_id, device_id_hash, channel_uri, created, updated)"
    f" SELECT %s, %s, %s, %s, %s WHERE {_CURRENT}"
    f" ON CONFLICT (app_id, device_id_hash) DO NOTHING RETURNING id"
)
# Locks the device row until commit (an UPDATE does, on both databases) and records the sign
# of life; the push component comes along in the same statement.
_TOUCH_DEVICE_SQL = (
    f"UPDATE {_DEVICES} SET updated = %s WHERE app_id = %s AND device_id_hash = %s"
    f" AND {_CURRENT}"
    f" RETURNING id, channel_uri, device_id_hash,"
    f" (SELECT c.id FROM {_COMPONENTS} c WHERE c.app_id = %s AND c.enabled = %s"
    f"  ORDER BY c.id LIMIT 1) AS push_component_id,"
    f" (SELECT c.jid FROM {_COMPONENTS} c WHERE c.app_id = %s AND c.enabled = %s"
    f"  ORDER BY c.id LIMIT 1) AS push_component_jid"
)
_SET_CHANNEL_SQL = (
    f"UPDATE {_DEVICES} SET channel_uri = %s, updated = %s"
    f" WHERE app_id = %s AND device_id_hash = %s AND {_CURRENT} RETURNING id"
)
_MINE_SQL = (
    f"SELECT id, device_hash, node, secret, account_domain, token, dead_since, component_id"
    f" FROM {_REGISTRATIONS} WHERE wns_device_id = %s"
)
# PostgreSQL: touching the device and reading its registrations in one statement.
_TOUCH_AND_READ_SQL = (
    f"WITH d AS ({_TOUCH_DEVICE_SQL})"
    f" SELECT d.*, r.id, r.device_hash, r.node, r.secret, r.account_domain, r.token,"
    f" r.dead_since, r.component_id"
    f" FROM d LEFT JOIN {_REGISTRATIONS} r ON r.wns_device_id = d.id"
)
# Renews only the rows still as they were read (same token, alive): a renewal without a
# lifecycle event; the others (changed meanwhile by a worker) go through lifecycle.
_RENEW_SQL = (
    f"UPDATE {_REGISTRATIONS} SET component_id = %s, token = %s, dead_since = NULL,"
    f" updated = %s WHERE token = %s AND dead_since IS NULL AND id IN {{ids}} RETURNING id"
)
_INSERT_REGISTRATIONS_SQL = (
    f"INSERT INTO {_REGISTRATIONS} (app_id, component_id, service, wns_device_id, device_hash,"
    f" room_hash, account_domain, token, node, secret, created, updated) VALUES {{rows}}"
    f" RETURNING device_hash, id"
)
_TAKEN_SQL = (
    f"SELECT device_hash FROM {_REGISTRATIONS} WHERE app_id = %s AND service = %s"
    f" AND room_hash = '' AND (wns_device_id IS NULL OR wns_device_id <> %s)"
    f" AND device_hash IN "
)


def _fetchall(sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Run one statement on Django's connection (in its transaction, if any): its rows.

    On PostgreSQL as a prepared statement of the psycopg connection underneath: Django binds
    parameters on the client, so the server parsed and planned every statement of every
    request again. Errors come out as Django's (IntegrityError and the rest), as from any
    query, and the connection is health-checked first, as Django's cursor() does."""
    if connection.vendor != "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall() if cursor.description is not None else []
    import psycopg

    connection.close_if_health_check_failed()
    connection.ensure_connection()
    raw = connection.connection
    if raw.prepare_threshold is None:
        # Django turns preparing off (None), which also ignores prepare=True; a threshold no
        # query reaches keeps Django's own queries unprepared and lets these be prepared.
        raw.prepare_threshold = 2**31
    with connection.wrap_database_errors, psycopg.Cursor(raw) as cursor:
        cursor.execute(sql, params, prepare=True)
        return cursor.fetchall() if cursor.description is not None else []


def _fetchone(sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
    rows = _fetchall(sql, params)
    return rows[0] if rows else None


def _insert_registrations(new: list[Registration], *, at: object) -> None:
    """One multi-row INSERT (the ORM's bulk_create built it at several times the cost)."""
    params: list[object] = []
    for reg in new:
        params += [reg.app_id, reg.component_id, reg.service, reg.wns_device_id]
        params += [reg.device_hash, reg.room_hash, reg.account_domain, reg.token]
        params += [reg.node, reg.secret, at, at]
    rows = ", ".join(["(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"] * len(new))
    ids = dict(_fetchall(_INSERT_REGISTRATIONS_SQL.format(rows=rows), params))
    for reg in new:
        reg.pk = ids[reg.device_hash]
        reg._state.adding = False


def _placeholders(count: int) -> str:
    return "(" + ", ".join(["%s"] * count) + ")"


def _db_time(value: datetime) -> object:
    return connection.ops.adapt_datetimefield_value(value)


@dataclass(slots=True)
class _Mine:
    """One of the device's registrations as read under the device's lock."""

    id: int
    device_hash: str
    node: str
    secret: str
    account_domain: str
    token: str
    dead: bool
    component_id: int


# --- the three actions ------------------------------------------------------------------------


def set_channel_uri(*, app: App, device_id: str, channel_uri: str) -> None:
    """Store the device's WNS channel; its accounts follow (the token of each registration).

    A new channel revives registrations that WNS had declared dead: the old channel died, this
    one is fresh. Sent again unchanged, it still counts as the device's sign of life.

    A new device is one statement, committed on its own; a known one is a transaction that
    updates the device and renews its registrations together.
    """
    validate_device_id(device_id)
    digest = device_id_hash(device_id)
    for _ in range(2):
        try:
            validate_channel_uri(app=app, channel_uri=channel_uri)
        except UwpxError:
            changed = _app_changed(app)  # the kept hosts may be older than the app's
            if changed is None:
                raise
            app = changed
            continue
        created = (
            _channel_group.submit(_ChannelItem(app, digest, channel_uri)) if _grouped() else None
        )
        if created is None:
            created = _on_live_connection(
                partial(_store_channel, app=app, digest=digest, channel_uri=channel_uri)
            )
        if created is not None:
            break
        changed = _app_changed(app)
        if changed is None:  # removed since the insert found it: the client sends again
            raise UwpxError(ErrorKind.UNAVAILABLE, "The device changed meanwhile; try again.")
        app = changed
    else:
        raise UwpxError(ErrorKind.UNAVAILABLE, "The app changed meanwhile; try again.")
    log.info("uwpx.channel_uri_set", extra={"app": app.pk, "new_device": created})


def _store_channel(*, app: App, digest: str, channel_uri: str) -> bool | None:
    """True: a new device; False: a known one updated; None: nothing done (the app is not
    as kept, or the device vanished between the two statements)."""
    now = timezone.now()
    at = _db_time(now)
    current = _app_params(app)
    if _fetchone(_NEW_DEVICE_SQL, [app.pk, digest, channel_uri, at, at, *current]) is not None:
        return True
    with transaction.atomic():
        row = _fetchone(_SET_CHANNEL_SQL, [channel_uri, at, app.pk, digest, *current])
        if row is None:
            return None
        lifecycle.renew_logged(
            Registration.objects.filter(wns_device_id=row[0]),
            token=channel_uri,
            dead_since=None,
            updated=now,
            at=now,
        )
    return False


def set_accounts(*, app: App, device_id: str, accounts: Sequence[AccountRef]) -> AccountsAnswer:
    """Make the device's accounts exactly `accounts`; an empty list turns push off.

    An account already registered for this device keeps its node and secret (its server keeps
    publishing there); accounts left out are removed at once.
    """
    validate_device_id(device_id)
    wanted = _resolve_accounts(device_id=device_id, accounts=accounts)

    def store(app: App) -> AccountsAnswer:
        with transaction.atomic():
            return _store_accounts(app=app, device_id=device_id, wanted=wanted)

    grouped = (
        _accounts_group.submit(_AccountsItem(app, device_id_hash(device_id), wanted))
        if _grouped()
        else None
    )
    attempt = 0
    while grouped is None:
        try:
            grouped = _on_live_connection(partial(store, app))
            break
        except IntegrityError:
            # A new node collided (72 random bits: astronomically rare) or a concurrent
            # request for the same account won a race: try the whole change again.
            attempt += 1
            if attempt == 3:
                raise
        except _AppChanged as changed:
            attempt += 1
            if attempt == 3:
                raise UwpxError(
                    ErrorKind.UNAVAILABLE, "The app changed meanwhile; try again."
                ) from None
            app = changed.app
    answer = grouped
    log.info(
        "uwpx.accounts_set",
        extra={"app": app.pk, "accounts": len(answer.accounts)},
    )
    return answer


def _new_registration(
    app: App, component_id: int, device_pk: int, wanted: _Wanted, channel_uri: str
) -> Registration:
    """A Windows device's registration for one account (the single and the batched path)."""
    return Registration(
        app=app,
        component_id=component_id,
        service=Service.WNS,
        wns_device_id=device_pk,
        device_hash=wanted.device_hash,
        room_hash="",
        account_domain=wanted.domain,
        token=channel_uri,
        node=new_node(),
        secret=new_secret(),
    )


def _store_accounts(*, app: App, device_id: str, wanted: list[_Wanted]) -> AccountsAnswer:
    """In one transaction: the device (locked and touched by one UPDATE), its registrations,
    and only what changed written back. A re-registration that changes nothing is two
    statements on PostgreSQL (touch the device and read its registrations, renew them),
    three on SQLite."""
    digest = device_id_hash(device_id)
    now = timezone.now()
    at = _db_time(now)
    touch = [at, app.pk, digest, *_app_params(app), app.pk, True, app.pk, True]
    if connection.vendor == "postgresql":
        rows = _fetchall(_TOUCH_AND_READ_SQL, touch)
        mine_rows = [r[5:] for r in rows if r[5] is not None]
    else:
        rows = _fetchall(_TOUCH_DEVICE_SQL, touch)
        mine_rows = _fetchall(_MINE_SQL, [rows[0][0]]) if rows else []
    if not rows:
        changed = _app_changed(app)  # UwpxError when it is gone or suspended
        if changed is not None:
            raise _AppChanged(changed)
    if not rows or not hmac.compare_digest(rows[0][2], digest):
        raise UwpxError(ErrorKind.UNKNOWN_DEVICE, UNKNOWN_DEVICE)
    device_pk, channel_uri, _, component_id, component_jid = rows[0][:5]
    if wanted and component_id is None:
        raise UwpxError(ErrorKind.UNAVAILABLE, "This app has no push component configured yet.")
    if wanted and not channels.wns_channel_sendable(app=app, channel_uri=channel_uri):
        changed = _app_changed(app)  # the kept hosts may be older than the app's
        if changed is not None:
            raise _AppChanged(changed)
        # The app's channel hosts changed since the channel was set: accounts registered now
        # would only collect dead letters.
        raise UwpxError(
            ErrorKind.CONFLICT,
            "The device's channel URI is no longer allowed, "
            + channels.why_not_sendable(app=app, channel_uri=channel_uri)
            + " Send set_channel_uri again with a channel URI the app may send to.",
        )
    existing = {
        mine.device_hash: mine
        for mine in (
            _Mine(r[0], r[1], r[2], r[3], r[4], r[5], r[6] is not None, r[7]) for r in mine_rows
        )
    }
    fresh = [item.device_hash for item in wanted if item.device_hash not in existing]
    if fresh:
        # Only an account id copied from elsewhere can collide: never hand out (or even
        # confirm) another device's registration.
        taken = {
            r[0]
            for r in _fetchall(
                _TAKEN_SQL + _placeholders(len(fresh)), [app.pk, Service.WNS, device_pk, *fresh]
            )
        }
        for item in wanted:
            if item.device_hash in taken:
                raise UwpxError(
                    ErrorKind.CONFLICT,
                    f"accounts[{item.index}] cannot be registered for this device.",
                )
    keep = {item.device_hash for item in wanted}
    gone = [mine.id for digest_, mine in existing.items() if digest_ not in keep]
    if gone:
        lifecycle.delete_logged(Registration.objects.filter(pk__in=gone), at=now)
    kept = [existing[item.device_hash] for item in wanted if item.device_hash in existing]
    if kept:
        quiet = [mine.id for mine in kept if mine.token == channel_uri and not mine.dead]
        renewed: set[int] = set()
        if quiet:
            renewed = {
                r[0]
                for r in _fetchall(
                    _RENEW_SQL.format(ids=_placeholders(len(quiet))),
                    [component_id, channel_uri, at, channel_uri, *quiet],
                )
            }
        logged = [mine.id for mine in kept if mine.id not in renewed]
        if logged:
            # A new token or a revival: a renewal the reports must see.
            lifecycle.renew_logged(
                Registration.objects.filter(pk__in=logged),
                component_id=component_id,
                token=channel_uri,
                dead_since=None,
                updated=now,
                at=now,
            )
    for item in wanted:
        found = existing.get(item.device_hash)
        if found is not None and item.domain and found.account_domain != item.domain:
            Registration.objects.filter(pk=found.id).update(account_domain=item.domain)
    new = [
        _new_registration(app, component_id, device_pk, item, channel_uri)
        for item in wanted
        if item.device_hash not in existing
    ]
    if new:
        _insert_registrations(new, at=at)
        lifecycle.created(new, at=now, tenant_id=app.tenant_id)
    return _answer(wanted, existing, {reg.device_hash: reg for reg in new}, component_jid)


def _answer(
    wanted: list[_Wanted],
    existing: dict[str, _Mine],
    created: dict[str, Registration],
    component_jid: str | None,
) -> AccountsAnswer:
    answers = []
    for item in wanted:
        reg = existing.get(item.device_hash) or created[item.device_hash]
        answers.append(
            AccountAnswer(
                bare_jid=item.ref.bare_jid,
                account_id=item.device_hash,
                node=reg.node,
                secret=reg.secret,
            )
        )
    return AccountsAnswer(push_bare_jid=component_jid or "", accounts=answers)


# --- group commit (PostgreSQL) ------------------------------------------------------------------
# The Windows clients' two hot requests, made by a process's threads at the same moment, share
# their statements and one commit (relay.services.groupcommit): a batch of re-registrations
# is BEGIN, one read that locks every device, one write, COMMIT, whatever its size; first
# registrations add the check that no account id is taken and the lifecycle events, and new
# devices are one INSERT for the batch. Each thread answers only once the batch committed.
# Only the plain cases are written in a batch: a request that would change or remove
# accounts, meet an error or a race, or repeat a device of the batch is left to its own
# transaction (the functions above), so every error and every rarer change stays on the one
# path that has always answered them. Errors of a whole batch (a deadlock, a collision of two
# new accounts) send every request of it to its own path too: a batch never answers with an
# error of another request's making.

_UNNEST_APPS = "%s::bigint[], %s::bigint[], %s::text[], %s::text[]"
_BATCH_CURRENT = (
    f"EXISTS (SELECT 1 FROM {App._meta.db_table} ca JOIN {Tenant._meta.db_table} ct"
    f" ON ct.id = ca.tenant_id WHERE ca.id = w.app_id AND ca.tenant_id = w.tenant_id"
    f" AND ca.public_key = w.public_key AND ca.wns_channel_hosts = w.hosts AND NOT ct.suspended)"
)
_BATCH_NEW_DEVICES_SQL = (
    f"INSERT INTO {_DEVICES} (app_id, device_id_hash, channel_uri, created, updated)"
    f" SELECT w.app_id, w.device_hash, w.channel, %s, %s"
    f" FROM unnest({_UNNEST_APPS}, %s::text[], %s::text[])"
    f" AS w(app_id, tenant_id, public_key, hosts, device_hash, channel)"
    f" WHERE {_BATCH_CURRENT}"
    f" ON CONFLICT (app_id, device_id_hash) DO NOTHING RETURNING app_id, device_id_hash"
)
# Locks the devices in id order (two batches never wait on each other in a circle).
_BATCH_READ_SQL = (
    f"WITH w AS (SELECT * FROM unnest({_UNNEST_APPS}, %s::text[], %s::int[])"
    f" AS w(app_id, tenant_id, public_key, hosts, device_hash, ord)),"
    f" d AS (SELECT w.ord, dv.id, dv.channel_uri, dv.device_id_hash, dv.app_id"
    f" FROM w JOIN {_DEVICES} dv ON dv.app_id = w.app_id AND dv.device_id_hash = w.device_hash"
    f" WHERE {_BATCH_CURRENT} ORDER BY dv.id FOR UPDATE OF dv)"
    f" SELECT d.ord, d.id, d.channel_uri, d.device_id_hash,"
    f" (SELECT c.id FROM {_COMPONENTS} c WHERE c.app_id = d.app_id AND c.enabled"
    f"  ORDER BY c.id LIMIT 1),"
    f" (SELECT c.jid FROM {_COMPONENTS} c WHERE c.app_id = d.app_id AND c.enabled"
    f"  ORDER BY c.id LIMIT 1),"
    f" r.id, r.device_hash, r.node, r.secret, r.account_domain, r.token, r.dead_since,"
    f" r.component_id"
    f" FROM d LEFT JOIN {_REGISTRATIONS} r ON r.wns_device_id = d.id"
)
_BATCH_TAKEN_SQL = (
    f"SELECT app_id, device_hash, wns_device_id FROM {_REGISTRATIONS}"
    f" WHERE service = %s AND room_hash = '' AND device_hash = ANY(%s::text[])"
)
# The devices touched, the kept registrations renewed (only those still as read: same token,
# alive), the new ones inserted: one statement.
_BATCH_WRITE_SQL = (
    f"WITH t AS (UPDATE {_DEVICES} SET updated = %s WHERE id = ANY(%s::bigint[]) RETURNING id),"
    f" r AS (UPDATE {_REGISTRATIONS} g SET component_id = v.component_id, updated = %s"
    f" FROM unnest(%s::bigint[], %s::bigint[], %s::text[]) AS v(id, component_id, token)"
    f" WHERE g.id = v.id AND g.token = v.token AND g.dead_since IS NULL RETURNING g.id),"
    f" i AS (INSERT INTO {_REGISTRATIONS} (app_id, component_id, service, wns_device_id,"
    f" device_hash, room_hash, account_domain, token, node, secret, created, updated)"
    f" SELECT n.app_id, n.component_id, %s, n.device_id, n.device_hash, '', n.domain, n.token,"
    f" n.node, n.secret, %s, %s FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[],"
    f" %s::text[], %s::text[], %s::text[], %s::text[], %s::text[])"
    f" AS n(app_id, component_id, device_id, device_hash, domain, token, node, secret)"
    f" RETURNING id, wns_device_id, device_hash)"
    f" SELECT 0, id, '' FROM r UNION ALL SELECT wns_device_id, id, device_hash FROM i"
)


def _grouped() -> bool:
    """Batches run on the thread that leads them, on its connection: only outside any
    transaction of the caller's, and on PostgreSQL (arrays, data-modifying CTEs)."""
    return connection.vendor == "postgresql" and not connection.in_atomic_block


def _apps_columns(apps: Sequence[App]) -> list[list[object]]:
    return [list(column) for column in zip(*(_app_params(app) for app in apps), strict=True)]


@dataclass(frozen=True, slots=True)
class _ChannelItem:
    app: App
    digest: str
    channel_uri: str


def _write_new_devices(items: Sequence[_ChannelItem]) -> list[bool | None]:
    """True for each device created; None: not created here (known device, changed app)."""

    def insert() -> set[tuple[int, str]]:
        at = _db_time(timezone.now())
        rows = _fetchall(
            _BATCH_NEW_DEVICES_SQL,
            [
                at,
                at,
                *_apps_columns([item.app for item in items]),
                [item.digest for item in items],
                [item.channel_uri for item in items],
            ],
        )
        return {(row[0], row[1]) for row in rows}

    created = _on_live_connection(insert)
    results: list[bool | None] = []
    for item in items:
        key = (item.app.pk, item.digest)
        results.append(True if key in created else None)
        created.discard(key)  # the same device twice: the second one on its own path
    return results


_channel_group: GroupCommit[_ChannelItem, bool | None] = GroupCommit(_write_new_devices)


@dataclass(frozen=True, slots=True)
class _AccountsItem:
    app: App
    digest: str
    wanted: list[_Wanted]


@dataclass(slots=True)
class _Plan:
    """What the batch writes for one request, and its answer once written."""

    item: _AccountsItem
    device_pk: int
    channel_uri: str
    component_id: int
    component_jid: str
    existing: dict[str, _Mine]
    new: list[Registration]


def _write_accounts(items: Sequence[_AccountsItem]) -> list[AccountsAnswer | None]:
    """The batch's answers; None for each request left to its own transaction."""
    try:
        return _on_live_connection(lambda: _write_accounts_once(items))
    except DatabaseError as error:
        # Two requests of the batch claiming one new account, a node collision, a deadlock:
        # each request is tried alone. A database that is down fails every request.
        if not isinstance(error, IntegrityError) and not _rolled_back(error):
            raise
        log.info("uwpx.batch_failed", extra={"error_type": type(error).__name__})
        return [None] * len(items)


def _rolled_back(error: BaseException) -> bool:
    """A deadlock or serialization failure: the transaction failed, the database is fine."""
    import psycopg

    return isinstance(error.__cause__, psycopg.errors.TransactionRollback)


def _write_accounts_once(items: Sequence[_AccountsItem]) -> list[AccountsAnswer | None]:
    now = timezone.now()
    at = _db_time(now)
    with transaction.atomic():
        rows = _fetchall(
            _BATCH_READ_SQL,
            [
                *_apps_columns([item.app for item in items]),
                [item.digest for item in items],
                list(range(len(items))),
            ],
        )
        plans = _plans(items, rows)
        _drop_taken(plans)
        live = [plan for plan in plans if plan is not None]
        renew: list[tuple[int, int, str]] = []
        insert: list[Registration] = []
        for plan in live:
            renew += [
                (mine.id, plan.component_id, plan.channel_uri) for mine in plan.existing.values()
            ]
            insert += plan.new
        if not live:
            return [None] * len(items)
        renew_columns = [list(column) for column in zip(*renew, strict=True)] or [[], [], []]
        written = _fetchall(
            _BATCH_WRITE_SQL,
            [
                at,
                [plan.device_pk for plan in live],
                at,
                *renew_columns,
                Service.WNS,
                at,
                at,
                [reg.app_id for reg in insert],
                [reg.component_id for reg in insert],
                [reg.wns_device_id for reg in insert],
                [reg.device_hash for reg in insert],
                [reg.account_domain for reg in insert],
                [reg.token for reg in insert],
                [reg.node for reg in insert],
                [reg.secret for reg in insert],
            ],
        )
        renewed = {row[1] for row in written if row[0] == 0}
        inserted = {(row[0], row[2]): row[1] for row in written if row[0] != 0}
        for reg in insert:
            reg.pk = inserted[(reg.wns_device_id, reg.device_hash)]
            reg._state.adding = False
        by_tenant: dict[int, list[Registration]] = {}
        for plan in live:
            by_tenant.setdefault(plan.item.app.tenant_id, []).extend(plan.new)
        for tenant_id, new in by_tenant.items():
            lifecycle.created(new, at=now, tenant_id=tenant_id)
    answers: list[AccountsAnswer | None] = []
    for planned in plans:
        if planned is None or any(m.id not in renewed for m in planned.existing.values()):
            # Changed by a worker since it was read (a channel died): its own path logs it.
            answers.append(None)
            continue
        answers.append(
            _answer(
                planned.item.wanted,
                planned.existing,
                {reg.device_hash: reg for reg in planned.new},
                planned.component_jid,
            )
        )
    return answers


def _plans(items: Sequence[_AccountsItem], rows: list[tuple[Any, ...]]) -> list[_Plan | None]:
    """Each request that the batch can write as it is, from the rows read under lock."""
    by_ord: dict[int, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_ord.setdefault(row[0], []).append(row)
    plans: list[_Plan | None] = []
    devices: set[int] = set()
    for ord_, item in enumerate(items):
        found = by_ord.get(ord_)
        if not found or not hmac.compare_digest(found[0][3], item.digest):
            plans.append(None)  # unknown device or changed app: its own path says which
            continue
        _, device_pk, channel_uri, _, component_id, component_jid = found[0][:6]
        existing = {
            r[7]: _Mine(r[6], r[7], r[8], r[9], r[10], r[11], r[12] is not None, r[13])
            for r in found
            if r[6] is not None
        }
        keep = {wanted.device_hash for wanted in item.wanted}
        plain = (
            device_pk not in devices
            and component_id is not None
            and channels.wns_channel_sendable(app=item.app, channel_uri=channel_uri)
            and keep.issuperset(existing)
            and all(mine.token == channel_uri and not mine.dead for mine in existing.values())
            and all(
                not wanted.domain or existing[wanted.device_hash].account_domain == wanted.domain
                for wanted in item.wanted
                if wanted.device_hash in existing
            )
        )
        devices.add(device_pk)
        if not plain:
            plans.append(None)
            continue
        new = [
            _new_registration(item.app, component_id, device_pk, wanted, channel_uri)
            for wanted in item.wanted
            if wanted.device_hash not in existing
        ]
        plans.append(
            _Plan(item, device_pk, channel_uri, component_id, component_jid or "", existing, new)
        )
    return plans


def _drop_taken(plans: list[_Plan | None]) -> None:
    """A new account whose id is registered elsewhere (or wanted twice in the batch): that
    request goes its own way, which refuses it as the single path does."""
    fresh = [reg.device_hash for plan in plans if plan is not None for reg in plan.new]
    if not fresh:
        return
    taken: dict[tuple[int, str], set[int | None]] = {}
    for app_id, digest, device in _fetchall(_BATCH_TAKEN_SQL, [Service.WNS, fresh]):
        taken.setdefault((app_id, digest), set()).add(device)
    claimed: set[tuple[int, str]] = set()
    for index, plan in enumerate(plans):
        if plan is None:
            continue
        keys = [(plan.item.app.pk, reg.device_hash) for reg in plan.new]
        if any(key in claimed or (taken.get(key, set()) - {plan.device_pk}) for key in keys):
            plans[index] = None
            continue
        claimed.update(keys)


_accounts_group: GroupCommit[_AccountsItem, AccountsAnswer | None] = GroupCommit(_write_accounts)


def request_test_push(*, app: App, device_id: str) -> str:
    """Queue one wake-up for the device's first account, through the normal send path.

    The same service as the admin's test push: the device receives the raw notification of
    docs/protocols.md 3.3 for that account (message count 0), exactly as a real push would reach it.
    Returns the push id.
    """
    validate_device_id(device_id)
    app = _load_app(app.public_key)  # rare and a real send: the app as it is now
    device = _device(app=app, device_id=device_id)
    registrations = Registration.objects.filter(wns_device=device).order_by("id")
    registration = registrations.filter(dead_since__isnull=True).first()
    if registration is None:
        if registrations.exists():
            raise UwpxError(
                ErrorKind.CONFLICT,
                "WNS no longer accepts this device's channel URI; send set_channel_uri again.",
            )
        raise UwpxError(
            ErrorKind.CONFLICT, "No push accounts are set for this device; send set_accounts first."
        )
    try:
        job = test_push.send_test_push(registration=registration)
    except queue.QueueUnavailable:
        raise UwpxError(
            ErrorKind.UNAVAILABLE, "The test push could not be queued; try again later."
        ) from None
    log.info("uwpx.test_push_queued", extra={"app": app.pk, "push_id": job.push_id})
    return job.push_id


# --- housekeeping -------------------------------------------------------------------------------


def remove_stale_devices(
    *, older_than_days: float | None = None, now: datetime | None = None
) -> int:
    """Delete devices (and their accounts) the client has not updated for that many days.

    WNS channels expire after 30 days and the client sends a new one when it starts, so a
    device silent for longer has a dead channel anyway. 0 or less disables the removal.
    """
    days = conf.current().uwpx_stale_days if older_than_days is None else older_than_days
    if days <= 0:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    removed = 0
    while True:
        batch = list(
            WnsDevice.objects.filter(updated__lt=cutoff).values_list("id", flat=True)[:1000]
        )
        if not batch:
            break
        lifecycle.delete_logged(Registration.objects.filter(wns_device_id__in=batch))
        WnsDevice.objects.filter(id__in=batch).delete()
        removed += len(batch)
    log.info("uwpx.stale_devices_removed", extra={"devices": removed, "days": days})
    return removed
