"""The table of messages the phone has not taken yet, and the delivery records they end as.

Hot path, on PostgreSQL: storing a POST is ONE statement (`_PG_STORE`, a chain of
data-modifying CTEs) that checks the revocation list, inserts the sealed message, replaces a
stored message with the same Topic, drops the endpoint's oldest least urgent message beyond
the storage bound, writes the delivery records of what it replaced or dropped, and wakes the
gateway with `pg_notify` carrying everything it needs to send (so it reads nothing back).
The gateway resolves what the phone answered in batches (`finish`): one statement per batch.
Other databases (SQLite for the embedded defaults) run the same steps in one transaction.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.db.models import F

from relay.services.groupcommit import GroupCommit
from relay.unifiedpush.models import (
    UnifiedPushDelivery,
    UnifiedPushMessage,
    UnifiedPushOutcome,
    UnifiedPushRevocation,
)

log = logging.getLogger(__name__)

CHANNEL = "relay_unifiedpush"
# pg_notify payloads must stay under 8000 bytes; beyond, the gateway reads the row instead.
MAX_NOTIFY_PAYLOAD = 7900

MESSAGES = UnifiedPushMessage._meta.db_table
REVOCATIONS = UnifiedPushRevocation._meta.db_table
DELIVERIES = UnifiedPushDelivery._meta.db_table
_RECORD_COLUMNS = (
    "tenant_id, component_id, outcome, urgency, received, finished, size, ttl, attempts"
)


@dataclass(frozen=True, slots=True)
class NewMessage:
    tenant_id: int
    component_id: int
    endpoint_key: str
    recipient_key: str
    topic_key: str
    urgency: int
    received: datetime
    expires: datetime
    endpoint_expires: datetime
    size: int
    ttl: int
    sealed: bytes
    # Set by the gateway when it stores a message it already sent (the direct path,
    # `relay.unifiedpush.gateway.relay`): no wake-up, and not due while its answer may still come.
    notify: bool = True
    next_attempt: datetime | None = None


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """A stored message as the gateway handles it (the sealed part opened only to send)."""

    id: int
    tenant_id: int
    component_id: int
    endpoint_key: str
    recipient_key: str
    urgency: int
    received: datetime
    expires: datetime
    endpoint_expires: datetime
    size: int
    ttl: int
    attempts: int
    sealed: bytes


def _epoch_us(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000)


def _from_us(value: int) -> datetime:
    return datetime.fromtimestamp(value / 1_000_000, UTC)


def _meta(message: NewMessage) -> str:
    """The notification's fields between the id and the sealed message, space separated."""
    return (
        f"{message.component_id} {message.tenant_id} {message.endpoint_key} "
        f"{message.recipient_key} {message.urgency} {_epoch_us(message.received)} "
        f"{_epoch_us(message.expires)} {_epoch_us(message.endpoint_expires)} {message.size} "
        f"{message.ttl}"
    )


def parse_notify_payload(payload: str) -> StoredMessage | int:
    """The message a notification carries, or only its id when it was too big to carry."""
    parts = payload.split(" ")
    if len(parts) != 12 or parts[11] == "-":
        return int(parts[0])
    return StoredMessage(
        id=int(parts[0]),
        component_id=int(parts[1]),
        tenant_id=int(parts[2]),
        endpoint_key=parts[3],
        recipient_key=parts[4],
        urgency=int(parts[5]),
        received=_from_us(int(parts[6])),
        expires=_from_us(int(parts[7])),
        endpoint_expires=_from_us(int(parts[8])),
        size=int(parts[9]),
        ttl=int(parts[10]),
        attempts=0,
        sealed=base64.b64decode(parts[11]),
    )


# The batch comes as ONE JSON parameter (psycopg adapts one JSON string far faster than
# fourteen arrays); bodies as base64. The endpoint's bound and
# Topic replacement look up only that endpoint's rows (index on endpoint_key, LATERAL).
_PG_STORE_BATCH = f"""
WITH input AS (
    SELECT * FROM jsonb_to_recordset(%(batch)s::jsonb) AS t(
        ord integer, tenant_id bigint, component_id bigint, endpoint_key text,
        recipient_key text, topic_key text, urgency smallint, received timestamptz,
        expires timestamptz, endpoint_expires timestamptz, size integer, ttl integer,
        sealed text, meta text, chunk integer, notify boolean, next_attempt timestamptz)
), accepted AS (
    SELECT nextval('{{sequence}}'::regclass) AS id, input.*
    FROM input
    WHERE NOT EXISTS (
        SELECT 1 FROM {REVOCATIONS} r WHERE r.endpoint_key = input.endpoint_key
    )
), stored AS (
    INSERT INTO {MESSAGES} (id, tenant_id, component_id, endpoint_key, recipient_key,
        topic_key, urgency, received, expires, endpoint_expires, next_attempt, attempts, size,
        ttl, sealed)
    SELECT id, tenant_id, component_id, endpoint_key, recipient_key, topic_key, urgency,
        received, expires, endpoint_expires, coalesce(next_attempt, received), 0, size, ttl,
        decode(sealed, 'base64')
    FROM accepted ORDER BY ord
), replaced AS (
    DELETE FROM {MESSAGES} m USING (
        SELECT old.id, a.received AS finished
        FROM accepted a CROSS JOIN LATERAL (
            SELECT o.id FROM {MESSAGES} o
            WHERE o.endpoint_key = a.endpoint_key AND o.topic_key = a.topic_key
        ) old
        WHERE a.topic_key <> ''
    ) gone
    WHERE m.id = gone.id
    RETURNING m.tenant_id, m.component_id, m.urgency, m.received, m.size, m.ttl, m.attempts,
        gone.finished
), limits AS (
    SELECT endpoint_key, greatest(0, %(max_per_endpoint)s - count(*)) AS keep,
        max(received) AS finished, array_agg(topic_key) AS topics
    FROM accepted GROUP BY endpoint_key
), dropped AS (
    DELETE FROM {MESSAGES} m USING (
        SELECT old.id, l.finished
        FROM limits l CROSS JOIN LATERAL (
            SELECT o.id FROM {MESSAGES} o
            WHERE o.endpoint_key = l.endpoint_key
                AND NOT (o.topic_key <> '' AND o.topic_key = ANY(l.topics))
            ORDER BY o.urgency DESC, o.id DESC OFFSET l.keep
        ) old
    ) gone
    WHERE m.id = gone.id
    RETURNING m.tenant_id, m.component_id, m.urgency, m.received, m.size, m.ttl, m.attempts,
        gone.finished
), recorded AS (
    INSERT INTO {DELIVERIES} ({_RECORD_COLUMNS})
    SELECT tenant_id, component_id, 'replaced', urgency, received, finished, size, ttl,
        attempts FROM replaced
    UNION ALL
    SELECT tenant_id, component_id, 'dropped', urgency, received, finished, size, ttl,
        attempts FROM dropped
), notified AS (
    SELECT pg_notify('{CHANNEL}', string_agg(
        id::text || ' ' || meta || ' ' || CASE WHEN length(sealed) < 6700 THEN sealed ELSE '-' END,
        E'\\n' ORDER BY ord))
    FROM accepted WHERE notify GROUP BY chunk
)
SELECT ord, id, (SELECT count(*) FROM dropped), (SELECT count(*) FROM notified) FROM accepted
"""
_statement_text: str | None = None


def _statement() -> str:
    """The batch statement with the message table's id sequence (looked up once)."""
    global _statement_text
    if _statement_text is None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [MESSAGES])
            sequence = cursor.fetchone()[0]
        _statement_text = _PG_STORE_BATCH.replace("{sequence}", sequence)
    return _statement_text


def store(message: NewMessage, *, max_per_endpoint: int) -> int | None:
    """Store a message: its id, or None when the endpoint is revoked.

    On PostgreSQL, concurrent calls of one process share a statement (group commit)."""
    if connection.vendor == "postgresql":
        return _group.submit((message, max_per_endpoint))
    return _store_portable(message, max_per_endpoint=max_per_endpoint)


def _write_batch(items: Sequence[tuple[NewMessage, int]]) -> list[int | None]:
    """Store a batch in as few statements as keep Topic replacement exact: a message whose
    endpoint and Topic already occur earlier in the batch starts the next statement."""
    results: list[int | None] = []
    part: list[NewMessage] = []
    seen: set[tuple[str, str]] = set()
    max_per_endpoint = items[0][1]
    for message, _ in items:
        key = (message.endpoint_key, message.topic_key)
        if message.topic_key and key in seen:
            results += _store_postgres(part, max_per_endpoint=max_per_endpoint)
            part, seen = [], set()
        part.append(message)
        seen.add(key)
    results += _store_postgres(part, max_per_endpoint=max_per_endpoint)
    return results


# Under concurrency (the last batch had company), the writer waits a millisecond for the
# POSTs on their way: bigger batches, fewer statements (bench/unifiedpush.py: about a quarter
# fewer commits per relay at 16 connections); a lone POST is written at once.
GATHER_SECONDS = 0.001
_group: GroupCommit[tuple[NewMessage, int], int | None] = GroupCommit(
    _write_batch, gather_seconds=GATHER_SECONDS
)


def _store_postgres(messages: Sequence[NewMessage], *, max_per_endpoint: int) -> list[int | None]:
    rows, chunk, size = [], 0, 0
    for ord_, message in enumerate(messages, start=1):
        sealed = base64.b64encode(message.sealed).decode()
        meta = _meta(message)
        line = len(meta) + (len(sealed) if len(sealed) < 6700 else 1) + 24
        if size and size + line > MAX_NOTIFY_PAYLOAD:
            chunk, size = chunk + 1, 0
        size += line
        rows.append(
            {
                "ord": ord_,
                "tenant_id": message.tenant_id,
                "component_id": message.component_id,
                "endpoint_key": message.endpoint_key,
                "recipient_key": message.recipient_key,
                "topic_key": message.topic_key,
                "urgency": message.urgency,
                "received": message.received.isoformat(),
                "expires": message.expires.isoformat(),
                "endpoint_expires": message.endpoint_expires.isoformat(),
                "size": message.size,
                "ttl": message.ttl,
                "sealed": sealed,
                "meta": meta,
                "chunk": chunk,
                "notify": message.notify,
                "next_attempt": (
                    message.next_attempt.isoformat() if message.next_attempt else None
                ),
            }
        )
    result = _execute_prepared(
        _statement(),
        {"batch": json.dumps(rows, separators=(",", ":")), "max_per_endpoint": max_per_endpoint},
    )
    ids: list[int | None] = [None] * len(messages)
    dropped = 0
    for ord_, message_id, dropped_count, _ in result:
        ids[ord_ - 1] = int(message_id)
        dropped = dropped_count
    if dropped:
        log.info(
            "unifiedpush.dropped",
            extra={"component_id": messages[0].component_id, "dropped": dropped},
        )
    return ids


def _execute_prepared(query: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run one statement on Django's connection, prepared on the server.

    Django binds parameters on the client (so nothing is ever prepared) and checks a reused
    connection with an extra `SELECT 1` per request; on the hot path that doubled the round
    trips and re-planned the CTE chain every time. Here the psycopg connection underneath
    runs it as a named prepared statement (psycopg's cache, per connection); a connection
    that fails is closed, and Django opens a fresh one for the next request. Errors come out
    as Django's DatabaseError, like any query.
    """
    import psycopg

    if connection.in_atomic_block:  # inside a transaction (tests): stay on Django's path
        with connection.cursor() as cursor:
            cursor.execute(query, params)
            return list(cursor.fetchall())
    connection.ensure_connection()
    raw = connection.connection
    if raw.prepare_threshold is None:
        # Django turns preparing off (None), which also ignores prepare=True; a threshold no
        # query reaches keeps Django's own queries unprepared and lets ours be prepared.
        raw.prepare_threshold = 2**31
    try:
        with psycopg.Cursor(raw) as cursor:
            cursor.execute(query, params, prepare=True)
            return list(cursor.fetchall())
    except psycopg.Error as error:
        connection.close()
        raise DatabaseError(str(error)) from error


def _records(
    rows: Iterable[UnifiedPushMessage], outcome: str, finished: datetime, *, answered: bool = False
) -> list[UnifiedPushDelivery]:
    return [
        UnifiedPushDelivery(
            tenant_id=row.tenant_id,
            component_id=row.component_id,
            outcome=outcome,
            urgency=row.urgency,
            received=row.received,
            finished=finished,
            size=row.size,
            ttl=row.ttl,
            attempts=row.attempts + (1 if answered else 0),
        )
        for row in rows
    ]


_RECORD_FIELDS = (
    "id",
    "tenant_id",
    "component_id",
    "urgency",
    "received",
    "size",
    "ttl",
    "attempts",
)


def _store_portable(message: NewMessage, *, max_per_endpoint: int) -> int | None:
    with transaction.atomic():
        if UnifiedPushRevocation.objects.filter(endpoint_key=message.endpoint_key).exists():
            return None
        same_endpoint = UnifiedPushMessage.objects.filter(endpoint_key=message.endpoint_key)
        replaced: list[UnifiedPushMessage] = []
        if message.topic_key:
            replaced = list(same_endpoint.filter(topic_key=message.topic_key).only(*_RECORD_FIELDS))
            same_endpoint = same_endpoint.exclude(topic_key=message.topic_key)
        dropped = list(
            same_endpoint.order_by("-urgency", "-id").only(*_RECORD_FIELDS)[
                max(0, max_per_endpoint - 1) :
            ]
        )
        gone = [row.pk for row in replaced + dropped]
        if gone:
            UnifiedPushMessage.objects.filter(pk__in=gone).delete()
            UnifiedPushDelivery.objects.bulk_create(
                _records(replaced, UnifiedPushOutcome.REPLACED, message.received)
                + _records(dropped, UnifiedPushOutcome.DROPPED, message.received)
            )
        row = UnifiedPushMessage.objects.create(
            tenant_id=message.tenant_id,
            component_id=message.component_id,
            endpoint_key=message.endpoint_key,
            recipient_key=message.recipient_key,
            topic_key=message.topic_key,
            urgency=message.urgency,
            received=message.received,
            expires=message.expires,
            endpoint_expires=message.endpoint_expires,
            next_attempt=message.next_attempt or message.received,
            size=message.size,
            ttl=message.ttl,
            sealed=message.sealed,
        )
    if dropped:
        log.info(
            "unifiedpush.dropped",
            extra={"component_id": message.component_id, "dropped": len(dropped)},
        )
    return int(row.pk)


def _stored(row: UnifiedPushMessage) -> StoredMessage:
    return StoredMessage(
        id=row.pk,
        tenant_id=row.tenant_id,
        component_id=row.component_id,
        endpoint_key=row.endpoint_key,
        recipient_key=row.recipient_key,
        urgency=row.urgency,
        received=row.received,
        expires=row.expires,
        endpoint_expires=row.endpoint_expires,
        size=row.size,
        ttl=row.ttl,
        attempts=row.attempts,
        sealed=bytes(row.sealed),
    )


def by_ids(ids: Sequence[int]) -> list[StoredMessage]:
    return [_stored(row) for row in UnifiedPushMessage.objects.filter(pk__in=ids).order_by("id")]


def due(*, component_ids: Sequence[int], now: datetime, limit: int) -> list[StoredMessage]:
    """Messages of these components whose next attempt has come, oldest first."""
    rows = UnifiedPushMessage.objects.filter(
        component_id__in=component_ids, next_attempt__lte=now
    ).order_by("id")[:limit]
    return [_stored(row) for row in rows]


def for_recipient(*, component_id: int, recipient_keys: Sequence[str]) -> list[StoredMessage]:
    """Every stored message of one phone (full JID) on one component, oldest first."""
    rows = UnifiedPushMessage.objects.filter(
        component_id=component_id, recipient_key__in=recipient_keys
    ).order_by("id")
    return [_stored(row) for row in rows]


def finish(*, ids: Sequence[int], outcome: str, now: datetime, answered: bool) -> int:
    """Delete messages and write their delivery records; rows already gone are skipped (they
    were replaced, withdrawn or dropped meanwhile and have their record). One statement on
    PostgreSQL. Returns how many were finished."""
    if not ids:
        return 0
    if connection.vendor == "postgresql":
        [(count,)] = _execute_prepared(
            f"""
                WITH gone AS (
                    DELETE FROM {MESSAGES} WHERE id = ANY(%(ids)s)
                    RETURNING tenant_id, component_id, urgency, received, size, ttl, attempts
                ), recorded AS (
                    INSERT INTO {DELIVERIES} ({_RECORD_COLUMNS})
                    SELECT tenant_id, component_id, %(outcome)s, urgency, received, %(now)s,
                        size, ttl, attempts + %(answered)s FROM gone
                    RETURNING 1
                )
                SELECT count(*) FROM recorded
                """,
            {"ids": list(ids), "outcome": outcome, "now": now, "answered": int(answered)},
        )
        return int(count)
    with transaction.atomic():
        rows = list(
            UnifiedPushMessage.objects.select_for_update().filter(pk__in=ids).only(*_RECORD_FIELDS)
        )
        UnifiedPushMessage.objects.filter(pk__in=[row.pk for row in rows]).delete()
        UnifiedPushDelivery.objects.bulk_create(_records(rows, outcome, now, answered=answered))
    return len(rows)


def revoke(*, endpoint_key: str, tenant_id: int, until: datetime, now: datetime) -> int:
    """The phone refused this endpoint: remember it until the token expires, and end its
    stored messages as revoked. Returns how many messages ended."""
    with transaction.atomic():
        UnifiedPushRevocation.objects.get_or_create(
            endpoint_key=endpoint_key, defaults={"tenant_id": tenant_id, "expires": until}
        )
        ids = list(
            UnifiedPushMessage.objects.filter(endpoint_key=endpoint_key).values_list(
                "id", flat=True
            )
        )
        return finish(ids=ids, outcome=UnifiedPushOutcome.REVOKED, now=now, answered=True)


def withdraw(*, message_id: int, now: datetime) -> bool:
    """DELETE on a message resource: True if it was still stored."""
    return (
        finish(ids=[message_id], outcome=UnifiedPushOutcome.WITHDRAWN, now=now, answered=False) == 1
    )


def postpone(
    *, component_id: int, recipient_key: str, failed_ids: Sequence[int], until: datetime
) -> None:
    """A temporary failure: nothing for this phone is due before `until`."""
    with transaction.atomic():
        UnifiedPushMessage.objects.filter(pk__in=failed_ids).update(
            attempts=F("attempts") + 1, next_attempt=until
        )
        UnifiedPushMessage.objects.filter(
            component_id=component_id, recipient_key=recipient_key, next_attempt__lt=until
        ).update(next_attempt=until)


def expire(*, now: datetime, grace: timedelta, limit: int = 1000) -> int:
    """End messages whose TTL passed more than `grace` ago (the gateway ends those it tried
    itself at once), and forget revocations of expired tokens."""
    ids = list(
        UnifiedPushMessage.objects.filter(expires__lt=now - grace)
        .order_by("expires")
        .values_list("id", flat=True)[:limit]
    )
    ended = finish(ids=ids, outcome=UnifiedPushOutcome.EXPIRED, now=now, answered=False)
    UnifiedPushRevocation.objects.filter(expires__lt=now).delete()
    return ended


def count_sealed_with_other_keys(kids: Sequence[str]) -> int:
    """Stored messages whose seal names none of these keys (for the system check)."""
    placeholders = ", ".join(["%s"] * len(kids))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FROM {MESSAGES} WHERE substr(sealed, 1, 8) NOT IN ({placeholders})",
            [kid.encode() for kid in kids],
        )
        return int(cursor.fetchone()[0])


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    """How a message that was never stored ended (the gateway's direct path)."""

    tenant_id: int
    component_id: int
    outcome: str
    urgency: int
    received: datetime
    finished: datetime
    size: int
    ttl: int
    attempts: int


_PG_RECORD = f"""
INSERT INTO {DELIVERIES} ({_RECORD_COLUMNS})
SELECT {_RECORD_COLUMNS} FROM jsonb_to_recordset(%(rows)s::jsonb) AS t(
    tenant_id bigint, component_id bigint, outcome text, urgency smallint,
    received timestamptz, finished timestamptz, size integer, ttl integer, attempts integer)
"""


def record(records: Sequence[DeliveryRecord]) -> None:
    """Write the delivery records of messages that ended without being stored (one statement
    per batch on PostgreSQL, like `finish`)."""
    if not records:
        return
    if connection.vendor == "postgresql":
        rows = [
            {
                "tenant_id": r.tenant_id,
                "component_id": r.component_id,
                "outcome": r.outcome,
                "urgency": r.urgency,
                "received": r.received.isoformat(),
                "finished": r.finished.isoformat(),
                "size": r.size,
                "ttl": r.ttl,
                "attempts": r.attempts,
            }
            for r in records
        ]
        _execute_prepared(_PG_RECORD + " RETURNING 1", {"rows": json.dumps(rows)})
        return
    UnifiedPushDelivery.objects.bulk_create(
        [
            UnifiedPushDelivery(
                tenant_id=r.tenant_id,
                component_id=r.component_id,
                outcome=r.outcome,
                urgency=r.urgency,
                received=r.received,
                finished=r.finished,
                size=r.size,
                ttl=r.ttl,
                attempts=r.attempts,
            )
            for r in records
        ]
    )


def stored_index(component_ids: Sequence[int]) -> list[tuple[int, int, str]]:
    """(id, component, recipient key) of every stored message of these components: what the
    gateway must not overtake."""
    return list(
        UnifiedPushMessage.objects.filter(component_id__in=component_ids).values_list(
            "id", "component_id", "recipient_key"
        )
    )


def is_revoked(endpoint_key: str, *, now: datetime) -> bool:
    return UnifiedPushRevocation.objects.filter(
        endpoint_key=endpoint_key, expires__gte=now
    ).exists()


def revoked_keys(*, now: datetime) -> set[str]:
    """Endpoint keys revoked and not yet expired."""
    return set(
        UnifiedPushRevocation.objects.filter(expires__gte=now).values_list(
            "endpoint_key", flat=True
        )
    )
