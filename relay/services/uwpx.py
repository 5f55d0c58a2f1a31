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

from django.conf import settings
from django.core.cache import cache
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone
from slixmpp.jid import JID, InvalidJID

from relay import conf
from relay.identifiers import new_node, new_secret
from relay.models import App, Component, Registration, Service, WnsDevice
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


def _hit(scope: str, value: str, rate: Sequence[float]) -> None:
    """Count one request in a fixed window of the shared cache; UwpxError when over the limit.

    Fails open when the cache is unreachable: the limits protect the service, they must not
    take registration down with them.
    """
    limit, seconds = int(rate[0]), float(rate[1])
    if limit <= 0 or seconds <= 0:
        return
    now = time.time()
    window = int(now // seconds)
    key = f"{_limit_key(scope, value)}:{window}"
    try:
        cache.add(key, 0, timeout=int(seconds) + 1)
        try:
            hits = cache.incr(key)
        except ValueError:  # expired between add and incr
            cache.set(key, 1, timeout=int(seconds) + 1)
            hits = 1
    except Exception as error:  # any cache backend error: count nothing
        log.warning("uwpx.rate_limit_unavailable", extra={"error_type": type(error).__name__})
        return
    if hits > limit:
        retry_after = max(1.0, (window + 1) * seconds - now)
        log.info("uwpx.rate_limited", extra={"scope": scope})
        raise UwpxError(
            ErrorKind.RATE_LIMITED,
            f"Too many requests; try again in {int(retry_after + 0.999)} seconds.",
            retry_after=retry_after,
        )


def check_address_rate(*, client_address: str) -> None:
    """Per client address; checked before a request body is even parsed."""
    _hit("address", client_address, conf.current().uwpx_rate_limit_address)


def check_device_rate(*, device_id: str, action: str) -> None:
    """Per device id, with a tighter budget for test pushes (each one is a real WNS send)."""
    _hit("device", device_id, conf.current().uwpx_rate_limit_device)
    if action == "request_test_push":
        _hit("test-push", device_id, conf.current().uwpx_rate_limit_test_push)


# --- lookups ------------------------------------------------------------------------------------


def app_for_key(*, public_key: str) -> App:
    """The app named in the URL (or configured for the listener); refuses a suspended tenant."""
    app = None
    if isinstance(public_key, str) and _APP_KEY.fullmatch(public_key):
        app = (
            App.objects.select_related("tenant")
            # Not the credentials: nothing here needs them, and each one would be decrypted.
            .only("id", "tenant_id", "public_key", "wns_channel_hosts", "tenant__suspended")
            .filter(public_key=public_key)
            .first()
        )
    if app is None:
        raise UwpxError(ErrorKind.UNKNOWN_APP, "Unknown app key.")
    if app.tenant.suspended:
        raise UwpxError(ErrorKind.UNAVAILABLE, "This push service is suspended; try again later.")
    return app


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


# --- the three actions ------------------------------------------------------------------------


def set_channel_uri(*, app: App, device_id: str, channel_uri: str) -> None:
    """Store the device's WNS channel; its accounts follow (the token of each registration).

    A new channel revives registrations that WNS had declared dead: the old channel died, this
    one is fresh. Sent again unchanged, it still counts as the device's sign of life.
    """
    validate_device_id(device_id)
    validate_channel_uri(app=app, channel_uri=channel_uri)
    digest = device_id_hash(device_id)
    now = timezone.now()
    with transaction.atomic():
        device, created = WnsDevice.objects.select_for_update().get_or_create(
            app=app, device_id_hash=digest, defaults={"channel_uri": channel_uri}
        )
        if not created:
            WnsDevice.objects.filter(pk=device.pk).update(channel_uri=channel_uri, updated=now)
            lifecycle.renew_logged(
                Registration.objects.filter(wns_device=device),
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
    device = _device(app=app, device_id=device_id, for_update=True)
    component = push_component(app=app)
    if wanted and component is None:
        raise UwpxError(ErrorKind.UNAVAILABLE, "This app has no push component configured yet.")
    if wanted and not channels.wns_channel_sendable(app=app, channel_uri=device.channel_uri):
        # The app's channel hosts changed since the channel was set: accounts registered now
        # would only collect dead letters.
        raise UwpxError(
            ErrorKind.CONFLICT,
            "The device's channel URI is no longer allowed, "
            + channels.why_not_sendable(app=app, channel_uri=device.channel_uri)
            + " Send set_channel_uri again with a channel URI the app may send to.",
        )
    # One query for both: this device's registrations, and any other holder of a wanted hash.
    mine: dict[str, Registration] = {}
    taken: set[str] = set()
    for reg in Registration.objects.filter(
        Q(wns_device=device)
        | Q(
            app=app,
            service=Service.WNS,
            room_hash="",
            device_hash__in=[item.device_hash for item in wanted],
        )
    ):
        if reg.wns_device_id == device.pk:
            mine[reg.device_hash] = reg
        else:
            taken.add(reg.device_hash)
    for item in wanted:
        if item.device_hash in taken:
            # Only an account id copied from elsewhere can collide: never hand out (or even
            # confirm) another device's registration.
            raise UwpxError(
                ErrorKind.CONFLICT,
                f"accounts[{item.index}] cannot be registered for this device.",
            )
    existing = mine
    keep = {item.device_hash for item in wanted}
    gone = [reg.pk for digest, reg in existing.items() if digest not in keep]
    if gone:
        lifecycle.delete_logged(Registration.objects.filter(pk__in=gone))
    now = timezone.now()
    kept = [existing[item.device_hash].pk for item in wanted if item.device_hash in existing]
    if kept:
        assert component is not None
        lifecycle.renew_logged(
            Registration.objects.filter(pk__in=kept),
            component=component,
            token=device.channel_uri,
            dead_since=None,
            updated=now,
            at=now,
        )
    for item in wanted:
        found = existing.get(item.device_hash)
        if found is not None and item.domain and found.account_domain != item.domain:
            Registration.objects.filter(pk=found.pk).update(account_domain=item.domain)
    new = [
        Registration(
            app=app,
            component=component,
            service=Service.WNS,
            wns_device=device,
            device_hash=item.device_hash,
            room_hash="",
            account_domain=item.domain,
            token=device.channel_uri,
            node=new_node(),
            secret=new_secret(),
        )
        for item in wanted
        if item.device_hash not in existing
    ]
    if new:
        Registration.objects.bulk_create(new)
        lifecycle.created(new, at=now)
    created = {reg.device_hash: reg for reg in new}
    WnsDevice.objects.filter(pk=device.pk).update(updated=now)
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
    return AccountsAnswer(push_bare_jid=component.jid if component else "", accounts=answers)


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
