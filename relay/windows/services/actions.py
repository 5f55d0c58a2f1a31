"""The three actions of a Windows client (set_channel_uri, set_accounts,
request_test_push), each on its own transaction; the plain cases of the first two are
handed to the batch path (`batch`) when it runs."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from functools import partial

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from relay.models import App, Registration, Service
from relay.services import channels, lifecycle, queue, test_push
from relay.windows.models import WnsDevice
from relay.windows.services import batch, sql
from relay.windows.services.apps import AppChanged, app_changed, app_params, load_app
from relay.windows.services.errors import ErrorKind, UwpxError
from relay.windows.services.identifiers import (
    UNKNOWN_DEVICE,
    AccountRef,
    AccountsAnswer,
    Wanted,
    device_id_hash,
    resolve_accounts,
    validate_channel_uri,
    validate_device_id,
)
from relay.windows.services.store import Mine, accounts_answer, new_registration

log = logging.getLogger("relay.windows.services")


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
            changed = app_changed(app)  # the kept hosts may be older than the app's
            if changed is None:
                raise
            app = changed
            continue
        created = (
            batch.channel_group.submit(batch.ChannelItem(app, digest, channel_uri))
            if batch.grouped()
            else None
        )
        if created is None:
            created = sql.on_live_connection(
                partial(_store_channel, app=app, digest=digest, channel_uri=channel_uri)
            )
        if created is not None:
            break
        changed = app_changed(app)
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
    at = sql.db_time(now)
    current = app_params(app)
    if (
        sql.fetchone(sql.NEW_DEVICE_SQL, [app.pk, digest, channel_uri, at, at, *current])
        is not None
    ):
        return True
    with transaction.atomic():
        row = sql.fetchone(sql.SET_CHANNEL_SQL, [channel_uri, at, app.pk, digest, *current])
        if row is None:
            return None
        lifecycle.renew_logged(
            Registration.objects.filter(wns_account__device_id=row[0]),
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
    wanted = resolve_accounts(device_id=device_id, accounts=accounts)

    def store(app: App) -> AccountsAnswer:
        with transaction.atomic():
            return _store_accounts(app=app, device_id=device_id, wanted=wanted)

    grouped = (
        batch.accounts_group.submit(batch.AccountsItem(app, device_id_hash(device_id), wanted))
        if batch.grouped()
        else None
    )
    attempt = 0
    while grouped is None:
        try:
            grouped = sql.on_live_connection(partial(store, app))
            break
        except IntegrityError:
            # A new node collided (72 random bits: astronomically rare) or a concurrent
            # request for the same account won a race: try the whole change again.
            attempt += 1
            if attempt == 3:
                raise
        except AppChanged as changed:
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


def _store_accounts(*, app: App, device_id: str, wanted: list[Wanted]) -> AccountsAnswer:
    """In one transaction: the device (locked and touched by one UPDATE), its registrations,
    and only what changed written back. A re-registration that changes nothing is two
    statements on PostgreSQL (touch the device and read its registrations, renew them),
    three on SQLite."""
    digest = device_id_hash(device_id)
    now = timezone.now()
    at = sql.db_time(now)
    touch = [at, app.pk, digest, *app_params(app), app.pk, True, app.pk, True]
    if connection.vendor == "postgresql":
        rows = sql.fetchall(sql.TOUCH_AND_READ_SQL, touch)
        mine_rows = [r[5:] for r in rows if r[5] is not None]
    else:
        rows = sql.fetchall(sql.TOUCH_DEVICE_SQL, touch)
        mine_rows = sql.fetchall(sql.MINE_SQL, [rows[0][0]]) if rows else []
    if not rows:
        changed = app_changed(app)  # UwpxError when it is gone or suspended
        if changed is not None:
            raise AppChanged(changed)
    if not rows or not hmac.compare_digest(rows[0][2], digest):
        raise UwpxError(ErrorKind.UNKNOWN_DEVICE, UNKNOWN_DEVICE)
    device_pk, channel_uri, _, component_id, component_jid = rows[0][:5]
    if wanted and component_id is None:
        raise UwpxError(ErrorKind.UNAVAILABLE, "This app has no push component configured yet.")
    if wanted and not channels.wns_channel_sendable(app=app, channel_uri=channel_uri):
        changed = app_changed(app)  # the kept hosts may be older than the app's
        if changed is not None:
            raise AppChanged(changed)
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
            Mine(r[0], r[1], r[2], r[3], r[4], r[5], r[6] is not None, r[7]) for r in mine_rows
        )
    }
    fresh = [item.device_hash for item in wanted if item.device_hash not in existing]
    if fresh:
        # Only an account id copied from elsewhere can collide: never hand out (or even
        # confirm) another device's registration.
        taken = {
            r[0]
            for r in sql.fetchall(
                sql.TAKEN_SQL + sql.placeholders(len(fresh)),
                [app.pk, Service.WNS, device_pk, *fresh],
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
                for r in sql.fetchall(
                    sql.RENEW_SQL.format(ids=sql.placeholders(len(quiet))),
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
        new_registration(app, component_id, item, channel_uri)
        for item in wanted
        if item.device_hash not in existing
    ]
    if new:
        sql.insert_accounts(new, device_pk=device_pk, at=at)
        lifecycle.created(new, at=now, tenant_id=app.tenant_id)
    return accounts_answer(wanted, existing, {reg.device_hash: reg for reg in new}, component_jid)


def _device(*, app: App, device_id: str, for_update: bool = False) -> WnsDevice:
    digest = device_id_hash(device_id)
    devices = WnsDevice.objects.filter(app=app, device_id_hash=digest)
    if for_update:
        devices = devices.select_for_update()
    device = devices.first()
    if device is None or not hmac.compare_digest(device.device_id_hash, digest):
        raise UwpxError(ErrorKind.UNKNOWN_DEVICE, UNKNOWN_DEVICE)
    return device


def request_test_push(*, app: App, device_id: str) -> str:
    """Queue one wake-up for the device's first account, through the normal send path.

    The same service as the admin's test push: the device receives the raw notification of
    docs/protocols.md 3.3 for that account (message count 0), exactly as a real push would reach it.
    Returns the push id.
    """
    validate_device_id(device_id)
    app = load_app(app.public_key)  # rare and a real send: the app as it is now
    device = _device(app=app, device_id=device_id)
    registrations = Registration.objects.filter(wns_account__device=device).order_by("id")
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
