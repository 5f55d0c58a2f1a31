"""The batch path (PostgreSQL): concurrent requests of one process in one commit.

The Windows clients' two hot requests, made by a process's threads at the same moment, share
their statements and one commit (relay.services.groupcommit): a batch of re-registrations
is BEGIN, one read that locks every device, one write, COMMIT, whatever its size; first
registrations add the check that no account id is taken and the lifecycle events, and new
devices are one INSERT for the batch. Each thread answers only once the batch committed.
Only the plain cases are written in a batch: a request that would change or remove
accounts, meet an error or a race, or repeat a device of the batch is left to its own
transaction (`actions`), so every error and every rarer change stays on the one path that
answers them. Errors of a whole batch (a deadlock, a collision of two new accounts) send
every request of it to its own path too: a batch never answers with an error of another
request's making."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone

from relay.models import App, Registration, Service, Tenant
from relay.services import channels, lifecycle
from relay.services.groupcommit import GroupCommit
from relay.windows.services import sql
from relay.windows.services.apps import app_params
from relay.windows.services.identifiers import AccountsAnswer, Wanted
from relay.windows.services.store import Mine, accounts_answer, new_registration

log = logging.getLogger("relay.windows.services")

_UNNEST_APPS = "%s::bigint[], %s::bigint[], %s::text[], %s::bigint[]"
_BATCH_CURRENT = (
    f"EXISTS (SELECT 1 FROM {App._meta.db_table} ca JOIN {Tenant._meta.db_table} ct"
    f" ON ct.id = ca.tenant_id WHERE ca.id = w.app_id AND ca.tenant_id = w.tenant_id"
    f" AND ca.public_key = w.public_key"
    f" AND {sql.WNS_CREDENTIALS.format(app='ca')} = w.wns_credentials"
    f" AND NOT ct.suspended)"
)
_BATCH_NEW_DEVICES_SQL = (
    f"INSERT INTO {sql.DEVICES} (app_id, device_id_hash, channel_uri, created, updated)"
    f" SELECT w.app_id, w.device_hash, w.channel, %s, %s"
    f" FROM unnest({_UNNEST_APPS}, %s::text[], %s::text[])"
    f" AS w(app_id, tenant_id, public_key, wns_credentials, device_hash, channel)"
    f" WHERE {_BATCH_CURRENT}"
    f" ON CONFLICT (app_id, device_id_hash) DO NOTHING RETURNING app_id, device_id_hash"
)
# Locks the devices in id order (two batches never wait on each other in a circle).
_BATCH_READ_SQL = (
    f"WITH w AS (SELECT * FROM unnest({_UNNEST_APPS}, %s::text[], %s::int[])"
    f" AS w(app_id, tenant_id, public_key, wns_credentials, device_hash, ord)),"
    f" d AS (SELECT w.ord, dv.id, dv.channel_uri, dv.device_id_hash, dv.app_id"
    f" FROM w JOIN {sql.DEVICES} dv ON dv.app_id = w.app_id AND dv.device_id_hash = w.device_hash"
    f" WHERE {_BATCH_CURRENT} ORDER BY dv.id FOR UPDATE OF dv)"
    f" SELECT d.ord, d.id, d.channel_uri, d.device_id_hash,"
    f" (SELECT c.id FROM {sql.COMPONENTS} c WHERE c.app_id = d.app_id AND c.enabled"
    f"  ORDER BY c.id LIMIT 1),"
    f" (SELECT c.jid FROM {sql.COMPONENTS} c WHERE c.app_id = d.app_id AND c.enabled"
    f"  ORDER BY c.id LIMIT 1),"
    f" r.id, r.device_hash, r.node, r.secret, r.account_domain, r.token, r.dead_since,"
    f" r.component_id"
    f" FROM d LEFT JOIN {sql.ACCOUNTS} a ON a.device_id = d.id"
    f" LEFT JOIN {sql.REGISTRATIONS} r ON r.id = a.registration_id"
)
_BATCH_TAKEN_SQL = (
    f"SELECT r.app_id, r.device_hash, a.device_id FROM {sql.REGISTRATIONS} r"
    f" LEFT JOIN {sql.ACCOUNTS} a ON a.registration_id = r.id"
    f" WHERE r.service = %s AND r.room_hash = '' AND r.device_hash = ANY(%s::text[])"
)
# The devices touched, the kept registrations renewed (only those still as read: same token,
# alive), the new ones inserted with their links to their devices: one statement. An account
# id is one device's within an app (it hashes the device id), so (app, account id) finds the
# device of each inserted row.
_BATCH_WRITE_SQL = (
    f"WITH t AS (UPDATE {sql.DEVICES} SET updated = %s WHERE id = ANY(%s::bigint[]) RETURNING id),"
    f" r AS (UPDATE {sql.REGISTRATIONS} g SET component_id = v.component_id, updated = %s"
    f" FROM unnest(%s::bigint[], %s::bigint[], %s::text[]) AS v(id, component_id, token)"
    f" WHERE g.id = v.id AND g.token = v.token AND g.dead_since IS NULL RETURNING g.id),"
    f" n AS (SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[],"
    f" %s::text[], %s::text[], %s::text[], %s::text[], %s::text[])"
    f" AS n(app_id, component_id, device_id, device_hash, domain, token, node, secret)),"
    f" i AS (INSERT INTO {sql.REGISTRATIONS} (app_id, component_id, service,"
    f" device_hash, room_hash, account_domain, token, node, secret, created, updated)"
    f" SELECT n.app_id, n.component_id, %s, n.device_hash, '', n.domain, n.token,"
    f" n.node, n.secret, %s, %s FROM n RETURNING id, app_id, device_hash),"
    f" l AS (INSERT INTO {sql.ACCOUNTS} (registration_id, device_id)"
    f" SELECT i.id, n.device_id FROM i JOIN n ON n.app_id = i.app_id"
    f" AND n.device_hash = i.device_hash RETURNING registration_id, device_id)"
    f" SELECT 0, id, '' FROM r UNION ALL SELECT l.device_id, l.registration_id, i.device_hash"
    f" FROM l JOIN i ON i.id = l.registration_id"
)


def grouped() -> bool:
    """Batches run on the thread that leads them, on its connection: only outside any
    transaction of the caller's, and on PostgreSQL (arrays, data-modifying CTEs)."""
    return connection.vendor == "postgresql" and not connection.in_atomic_block


def _apps_columns(apps: Sequence[App]) -> list[list[object]]:
    return [list(column) for column in zip(*(app_params(app) for app in apps), strict=True)]


@dataclass(frozen=True, slots=True)
class ChannelItem:
    app: App
    digest: str
    channel_uri: str


def _write_new_devices(items: Sequence[ChannelItem]) -> list[bool | None]:
    """True for each device created; None: not created here (known device, changed app)."""

    def insert() -> set[tuple[int, str]]:
        at = sql.db_time(timezone.now())
        rows = sql.fetchall(
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

    created = sql.on_live_connection(insert)
    results: list[bool | None] = []
    for item in items:
        key = (item.app.pk, item.digest)
        results.append(True if key in created else None)
        created.discard(key)  # the same device twice: the second one on its own path
    return results


channel_group: GroupCommit[ChannelItem, bool | None] = GroupCommit(_write_new_devices)


@dataclass(frozen=True, slots=True)
class AccountsItem:
    app: App
    digest: str
    wanted: list[Wanted]


@dataclass(slots=True)
class _Plan:
    """What the batch writes for one request, and its answer once written."""

    item: AccountsItem
    device_pk: int
    channel_uri: str
    component_id: int
    component_jid: str
    existing: dict[str, Mine]
    new: list[Registration]


def write_accounts(items: Sequence[AccountsItem]) -> list[AccountsAnswer | None]:
    """The batch's answers; None for each request left to its own transaction."""
    try:
        return sql.on_live_connection(lambda: _write_accounts_once(items))
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


def _write_accounts_once(items: Sequence[AccountsItem]) -> list[AccountsAnswer | None]:
    now = timezone.now()
    at = sql.db_time(now)
    with transaction.atomic():
        rows = sql.fetchall(
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
        insert: list[tuple[int, Registration]] = []
        for plan in live:
            renew += [
                (mine.id, plan.component_id, plan.channel_uri) for mine in plan.existing.values()
            ]
            insert += [(plan.device_pk, reg) for reg in plan.new]
        if not live:
            return [None] * len(items)
        renew_columns = [list(column) for column in zip(*renew, strict=True)] or [[], [], []]
        written = sql.fetchall(
            _BATCH_WRITE_SQL,
            [
                at,
                [plan.device_pk for plan in live],
                at,
                *renew_columns,
                [reg.app_id for _, reg in insert],
                [reg.component_id for _, reg in insert],
                [device_pk for device_pk, _ in insert],
                [reg.device_hash for _, reg in insert],
                [reg.account_domain for _, reg in insert],
                [reg.token for _, reg in insert],
                [reg.node for _, reg in insert],
                [reg.secret for _, reg in insert],
                Service.WNS,
                at,
                at,
            ],
        )
        renewed = {row[1] for row in written if row[0] == 0}
        inserted = {(row[0], row[2]): row[1] for row in written if row[0] != 0}
        for device_pk, reg in insert:
            reg.pk = inserted[(device_pk, reg.device_hash)]
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
            accounts_answer(
                planned.item.wanted,
                planned.existing,
                {reg.device_hash: reg for reg in planned.new},
                planned.component_jid,
            )
        )
    return answers


def _plans(items: Sequence[AccountsItem], rows: list[tuple[Any, ...]]) -> list[_Plan | None]:
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
            r[7]: Mine(r[6], r[7], r[8], r[9], r[10], r[11], r[12] is not None, r[13])
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
            new_registration(item.app, component_id, wanted, channel_uri)
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
    for app_id, digest, device in sql.fetchall(_BATCH_TAKEN_SQL, [Service.WNS, fresh]):
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


accounts_group: GroupCommit[AccountsItem, AccountsAnswer | None] = GroupCommit(write_accounts)
