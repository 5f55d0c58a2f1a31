"""Plain SQL for the two hot requests, and the connection they run on.

set_channel_uri and set_accounts run for every Windows client start. Through the ORM each
would be about a dozen statements, each built anew; here they are a few fixed statements,
prepared on PostgreSQL, that both PostgreSQL and SQLite run (RETURNING and ON CONFLICT:
SQLite 3.35+). The rarer changes (accounts removed, a token renewed, a domain learnt) go
through the ORM and relay.services.lifecycle."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from django.db import InterfaceError, OperationalError, connection

from relay.models import App, Component, ProviderCredentials, Registration, Tenant
from relay.windows.models import WnsAccount, WnsDevice

log = logging.getLogger("relay.windows.services")

T = TypeVar("T")


def on_live_connection(action: Callable[[], T]) -> T:
    """Run `action` (a whole transaction, or statements each committed on its own), once
    more on a new connection when the kept one turns out dead at the request's first use.

    Django checks a kept connection with a `SELECT 1` before each request's first statement
    (CONN_HEALTH_CHECKS): a round trip per request for a connection that is nearly always
    alive. Here the request's own first statement is the check, and a connection found dead
    (the server restarted, a proxy dropped it) is replaced and the action run again, which is
    safe: nothing of a dead connection's open transaction was committed, and the actions are
    idempotent (a lost commit's answer is read back by the second run). A failure on a fresh
    or already used connection is the database's trouble and is raised."""
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


# --- the statements ------------------------------------------------------------------------------

APP_FIELDS = ("id", "tenant_id", "public_key")
# The id of the app's WNS credentials record (0: none): a new one on every change of them
# (relay.services.credentials.records.store), so comparing it tells a kept app is stale.
WNS_CREDENTIALS = (
    f"COALESCE((SELECT p.id FROM {ProviderCredentials._meta.db_table} p"
    f" WHERE p.app_id = {{app}}.id AND p.service = 'wns'), 0)"
)
APP_SQL = (
    f"SELECT a.id, a.tenant_id, a.public_key, {WNS_CREDENTIALS.format(app='a')}, t.suspended"
    f" FROM {App._meta.db_table} a JOIN {Tenant._meta.db_table} t ON t.id = a.tenant_id"
    f" WHERE a.public_key = %s"
)
DEVICES = WnsDevice._meta.db_table
ACCOUNTS = WnsAccount._meta.db_table
REGISTRATIONS = Registration._meta.db_table
COMPONENTS = Component._meta.db_table
# The app kept by app_for_key is still its row as it is: id, tenant, key, WNS credentials, and
# its tenant not suspended (params: app_params). Part of each action's first statement.
CURRENT = (
    f"EXISTS (SELECT 1 FROM {App._meta.db_table} ca JOIN {Tenant._meta.db_table} ct"
    f" ON ct.id = ca.tenant_id WHERE ca.id = %s AND ca.tenant_id = %s AND ca.public_key = %s"
    f" AND {WNS_CREDENTIALS.format(app='ca')} = %s AND NOT ct.suspended)"
)
# Creates the device unless it exists or the app changed (then nothing: no row returned).
NEW_DEVICE_SQL = (
    f"INSERT INTO {DEVICES} (app_id, device_id_hash, channel_uri, created, updated)"
    f" SELECT %s, %s, %s, %s, %s WHERE {CURRENT}"
    f" ON CONFLICT (app_id, device_id_hash) DO NOTHING RETURNING id"
)
# Locks the device row until commit (an UPDATE does, on both databases) and records the sign
# of life; the push component comes along in the same statement.
TOUCH_DEVICE_SQL = (
    f"UPDATE {DEVICES} SET updated = %s WHERE app_id = %s AND device_id_hash = %s"
    f" AND {CURRENT}"
    f" RETURNING id, channel_uri, device_id_hash,"
    f" (SELECT c.id FROM {COMPONENTS} c WHERE c.app_id = %s AND c.enabled = %s"
    f"  ORDER BY c.id LIMIT 1) AS push_component_id,"
    f" (SELECT c.jid FROM {COMPONENTS} c WHERE c.app_id = %s AND c.enabled = %s"
    f"  ORDER BY c.id LIMIT 1) AS push_component_jid"
)
SET_CHANNEL_SQL = (
    f"UPDATE {DEVICES} SET channel_uri = %s, updated = %s"
    f" WHERE app_id = %s AND device_id_hash = %s AND {CURRENT} RETURNING id"
)
MINE_SQL = (
    f"SELECT r.id, r.device_hash, r.node, r.secret, r.account_domain, r.token, r.dead_since,"
    f" r.component_id FROM {ACCOUNTS} a JOIN {REGISTRATIONS} r ON r.id = a.registration_id"
    f" WHERE a.device_id = %s"
)
# PostgreSQL: touching the device and reading its registrations in one statement.
TOUCH_AND_READ_SQL = (
    f"WITH d AS ({TOUCH_DEVICE_SQL})"
    f" SELECT d.*, r.id, r.device_hash, r.node, r.secret, r.account_domain, r.token,"
    f" r.dead_since, r.component_id"
    f" FROM d LEFT JOIN {ACCOUNTS} a ON a.device_id = d.id"
    f" LEFT JOIN {REGISTRATIONS} r ON r.id = a.registration_id"
)
# Renews only the rows still as they were read (same token, alive): a renewal without a
# lifecycle event; the others (changed meanwhile by a worker) go through lifecycle.
RENEW_SQL = (
    f"UPDATE {REGISTRATIONS} SET component_id = %s, token = %s, dead_since = NULL,"
    f" updated = %s WHERE token = %s AND dead_since IS NULL AND id IN {{ids}} RETURNING id"
)
INSERT_REGISTRATIONS_SQL = (
    f"INSERT INTO {REGISTRATIONS} (app_id, component_id, service, device_hash,"
    f" room_hash, account_domain, token, node, secret, created, updated) VALUES {{rows}}"
    f" RETURNING device_hash, id"
)
INSERT_ACCOUNTS_SQL = f"INSERT INTO {ACCOUNTS} (registration_id, device_id) VALUES {{rows}}"
# The app's registrations of these account ids that are not this device's accounts.
TAKEN_SQL = (
    f"SELECT r.device_hash FROM {REGISTRATIONS} r WHERE r.app_id = %s AND r.service = %s"
    f" AND r.room_hash = '' AND NOT EXISTS (SELECT 1 FROM {ACCOUNTS} a"
    f" WHERE a.registration_id = r.id AND a.device_id = %s)"
    f" AND r.device_hash IN "
)


def fetchall(sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
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


def fetchone(sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
    rows = fetchall(sql, params)
    return rows[0] if rows else None


def insert_accounts(new: list[Registration], *, device_pk: int, at: object) -> None:
    """The device's new registrations and their links: a multi-row INSERT each (cheaper than
    bulk_create building them), in the caller's transaction."""
    params: list[object] = []
    for reg in new:
        params += [reg.app_id, reg.component_id, reg.service]
        params += [reg.device_hash, reg.room_hash, reg.account_domain, reg.token]
        params += [reg.node, reg.secret, at, at]
    rows = ", ".join(["(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"] * len(new))
    ids = dict(fetchall(INSERT_REGISTRATIONS_SQL.format(rows=rows), params))
    links: list[object] = []
    for reg in new:
        reg.pk = ids[reg.device_hash]
        reg._state.adding = False
        links += [reg.pk, device_pk]
    fetchall(INSERT_ACCOUNTS_SQL.format(rows=", ".join(["(%s, %s)"] * len(new))), links)


def placeholders(count: int) -> str:
    return "(" + ", ".join(["%s"] * count) + ")"


def db_time(value: datetime) -> object:
    return connection.ops.adapt_datetimefield_value(value)
