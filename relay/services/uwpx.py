"""The UWPX-style registration protocol of Windows clients (docs/protocols.md section 3).

Both entry points, the HTTP API (`relay.api`) and the TLS listener (`run_uwpx_listener`), call
these functions: they validate, store and queue, and raise `UwpxError` carrying the text the
client is shown. The device id is the client's only capability, so only its SHA-256 is stored,
a device is found by that hash (a timing difference in the index lookup cannot reveal the id)
and the final equality checks use `hmac.compare_digest`. Nothing here logs a device id, a
channel URI, a JID, a node or a secret.

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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache
from django.db import IntegrityError, connection, transaction
from django.utils import timezone
from slixmpp.jid import JID, InvalidJID

from relay import conf
from relay.identifiers import new_node, new_secret
from relay.models import App, Component, Registration, Service, Tenant, WnsDevice
from relay.services import channels, lifecycle, queue, test_push

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

    One plain statement: it runs for every request, and the ORM's query building cost more
    than the query (the credentials are not read: each one would be decrypted)."""
    row = None
    if isinstance(public_key, str) and _APP_KEY.fullmatch(public_key):
        row = _fetchone(_APP_SQL, [public_key])
    if row is None:
        raise UwpxError(ErrorKind.UNKNOWN_APP, "Unknown app key.")
    if row[4]:
        raise UwpxError(ErrorKind.UNAVAILABLE, "This push service is suspended; try again later.")
    return App.from_db(connection.alias, list(_APP_FIELDS), list(row[:4]))


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
# Creates the device unless it exists (then nothing: no row returned).
_NEW_DEVICE_SQL = (
    f"INSERT INTO {_DEVICES} (app_id, device_id_hash, channel_uri, created, updated)"
    f" VALUES (%s, %s, %s, %s, %s) ON CONFLICT (app_id, device_id_hash) DO NOTHING RETURNING id"
)
# Locks the device row until commit (an UPDATE does, on both databases) and records the sign
# of life; the push component comes along in the same statement.
_TOUCH_DEVICE_SQL = (
    f"UPDATE {_DEVICES} SET updated = %s WHERE app_id = %s AND device_id_hash = %s"
    f" RETURNING id, channel_uri, device_id_hash,"
    f" (SELECT c.id FROM {_COMPONENTS} c WHERE c.app_id = %s AND c.enabled = %s"
    f"  ORDER BY c.id LIMIT 1) AS push_component_id,"
    f" (SELECT c.jid FROM {_COMPONENTS} c WHERE c.app_id = %s AND c.enabled = %s"
    f"  ORDER BY c.id LIMIT 1) AS push_component_jid"
)
_SET_CHANNEL_SQL = (
    f"UPDATE {_DEVICES} SET channel_uri = %s, updated = %s"
    f" WHERE app_id = %s AND device_id_hash = %s RETURNING id"
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
    validate_channel_uri(app=app, channel_uri=channel_uri)
    digest = device_id_hash(device_id)
    now = timezone.now()
    at = _db_time(now)
    created = _fetchone(_NEW_DEVICE_SQL, [app.pk, digest, channel_uri, at, at]) is not None
    if not created:
        with transaction.atomic():
            row = _fetchone(_SET_CHANNEL_SQL, [channel_uri, at, app.pk, digest])
            if row is None:  # removed since the insert found it: the client sends again
                raise UwpxError(ErrorKind.UNAVAILABLE, "The device changed meanwhile; try again.")
            lifecycle.renew_logged(
                Registration.objects.filter(wns_device_id=row[0]),
                token=channel_uri,
                dead_since=None,
                updated=now,
                at=now,
            )
    log.info("uwpx.channel_uri_set", extra={"app": app.pk, "new_device": created})


def set_accounts(*, app: App, device_id: str, accounts: Sequence[AccountRef]) -> AccountsAnswer:
    """Make the device's accounts exactly `accounts`; an empty list turns push off.

    An account already registered for this device keeps its node and secret (its server keeps
    publishing there); accounts left out are removed at once.
    """
    validate_device_id(device_id)
    wanted = _resolve_accounts(device_id=device_id, accounts=accounts)
    for attempt in range(3):
        try:
            with transaction.atomic():
                answer = _store_accounts(app=app, device_id=device_id, wanted=wanted)
            break
        except IntegrityError:
            # A new node collided (72 random bits: astronomically rare) or a concurrent
            # request for the same account won a race: try the whole change again.
            if attempt == 2:
                raise
    log.info(
        "uwpx.accounts_set",
        extra={"app": app.pk, "accounts": len(answer.accounts)},
    )
    return answer


def _store_accounts(*, app: App, device_id: str, wanted: list[_Wanted]) -> AccountsAnswer:
    """In one transaction: the device (locked and touched by one UPDATE), its registrations,
    and only what changed written back. A re-registration that changes nothing is two
    statements on PostgreSQL (touch the device and read its registrations, renew them),
    three on SQLite."""
    digest = device_id_hash(device_id)
    now = timezone.now()
    at = _db_time(now)
    touch = [at, app.pk, digest, app.pk, True, app.pk, True]
    if connection.vendor == "postgresql":
        rows = _fetchall(_TOUCH_AND_READ_SQL, touch)
        mine_rows = [r[5:] for r in rows if r[5] is not None]
    else:
        rows = _fetchall(_TOUCH_DEVICE_SQL, touch)
        mine_rows = _fetchall(_MINE_SQL, [rows[0][0]]) if rows else []
    if not rows or not hmac.compare_digest(rows[0][2], digest):
        raise UwpxError(ErrorKind.UNKNOWN_DEVICE, UNKNOWN_DEVICE)
    device_pk, channel_uri, _, component_id, component_jid = rows[0][:5]
    if wanted and component_id is None:
        raise UwpxError(ErrorKind.UNAVAILABLE, "This app has no push component configured yet.")
    if wanted and not channels.wns_channel_sendable(app=app, channel_uri=channel_uri):
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
        Registration(
            app=app,
            component_id=component_id,
            service=Service.WNS,
            wns_device_id=device_pk,
            device_hash=item.device_hash,
            room_hash="",
            account_domain=item.domain,
            token=channel_uri,
            node=new_node(),
            secret=new_secret(),
        )
        for item in wanted
        if item.device_hash not in existing
    ]
    if new:
        _insert_registrations(new, at=at)
        lifecycle.created(new, at=now, tenant_id=app.tenant_id)
    created = {reg.device_hash: reg for reg in new}
    answers = []
    for item in wanted:
        mine = existing.get(item.device_hash)
        reg = mine or created[item.device_hash]
        node, secret = reg.node, reg.secret
        answers.append(
            AccountAnswer(
                bare_jid=item.ref.bare_jid,
                account_id=item.device_hash,
                node=node,
                secret=secret,
            )
        )
    return AccountsAnswer(push_bare_jid=component_jid or "", accounts=answers)


def request_test_push(*, app: App, device_id: str) -> str:
    """Queue one wake-up for the device's first account, through the normal send path.

    The same service as the admin's test push: the device receives the raw notification of
    docs/protocols.md 3.3 for that account (message count 0), exactly as a real push would reach it.
    Returns the push id.
    """
    validate_device_id(device_id)
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
