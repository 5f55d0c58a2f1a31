"""Sending one queued push and deciding what its outcome means.

Providers only classify (delivered / dead token / retry later / failed); this module decides
what follows:

- delivered: recorded, the registration's `last_push` moves.
- dead token: the registration dies (the next publish is answered item-not-found).
- retry later: deferred as a copy with the SAME push id, attempt + 1 and a delay: exponential
  backoff with full jitter, never sooner than the provider's Retry-After (capped at
  SEND_RETRY_MAX_SECONDS), and at least SEND_QUOTA_MIN_SECONDS after a quota error without
  one. Bounded by SEND_MAX_ATTEMPTS and by age: a wake-up that would go out later than
  SEND_MAX_AGE_SECONDS after the publish is useless, so it is given up at once. The copy is a
  row in the database (relay/services/deferred.py), written with the batch's bookkeeping, not a
  broker countdown; the workers' sweep queues it once due.
- failed, retries exhausted or too old: a dead letter
  (relay/services/dead_letters.py) that the admin can replay, plus the Delivery record.

Before anything is sent, a job older than SEND_MAX_AGE_SECONDS is given up ("too old: not
sent"): it may have waited for the database, or for a worker that died.

The database may go away at any moment (a restart, a failover). A dead connection is closed
and the operation retried on a new one for DATABASE_RETRY_SECONDS; after that:

- before anything was sent (reading the batch's registrations): DatabaseUnavailable, and the
  task hands the whole message back to the broker with backoff (relay/tasks.py);
- after the sends (writing what they taught, the `Bookkeeping`): RecordPending, and the task
  queues the bookkeeping itself as a message of its own that is written once the database
  is back. Nothing is sent twice for it, and nothing is acknowledged before it is kept.

Every final outcome is one Delivery row per push id. A push redelivered after a worker died
(acks_late) or replayed from a dead letter keeps its push id, so its row is updated, not
doubled, and the providers see the same id (APNs `apns-id`; FCM and WNS when the app's payload
options name a key for it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connection,
    connections,
    transaction,
)
from django.db.models import Field
from django.utils import timezone

from relay import conf, metrics
from relay.models import App, DeadLetter, Delivery, Priority, Registration
from relay.providers.base import Outcome, SendResult, Wakeup
from relay.services import deferred, lifecycle, queue, throttling
from relay.services import provider_limits as limits
from relay.services import provider_registry as registry

log = logging.getLogger(__name__)
T = TypeVar("T")

LAST_PUSH_RESOLUTION_SECONDS = 60
# Codes that mean "you are sending too much": back off for longer than for a hiccup.
QUOTA_CODES = frozenset(
    {"QUOTA_EXCEEDED", "HTTP_429", "TooManyRequests", "TooManyProviderTokenUpdates", "THROTTLED"}
)


def retry_delay(attempt: int, retry_after: float | None, *, quota: bool = False) -> float:
    """Seconds before attempt `attempt + 1`: full jitter over an exponential ceiling, above
    the provider's Retry-After (or the quota minimum), never above SEND_RETRY_MAX_SECONDS.

    The jitter is added on top of a Retry-After so that a burst refused together does not
    come back together.
    """
    base = conf.current().send_retry_base_seconds
    cap = conf.current().send_retry_max_seconds
    jitter = random.uniform(0, min(cap, base * (2 ** (max(attempt, 1) - 1))))
    floor = 0.0
    if retry_after is not None:
        floor = min(max(retry_after, 0.0), cap)
    elif quota:
        floor = min(conf.current().send_quota_min_seconds, cap)
    if not floor:
        return jitter
    return min(cap, floor + jitter)


def _age_seconds(job: queue.SendJob, now: datetime) -> float:
    start = datetime.fromisoformat(job.replayed or job.received)
    return (now - start).total_seconds()


def _wakeup(registration: Registration, job: queue.SendJob) -> Wakeup:
    return Wakeup(
        push_id=job.push_id,
        token=registration.token,
        account=registration.device_hash,
        channel=registration.room_hash,
        important=job.important,
        message_count=job.message_count,
        pending_subscription_count=job.pending_subscription_count,
    )


def _send_group(group: list[tuple[Registration, queue.SendJob]]) -> list[SendResult]:
    """Send wake-ups that share an app and a service through one provider, within the app's
    bulkhead and breaker (relay/services/provider_limits.py)."""
    registration = group[0][0]
    try:
        provider = registry.provider_for(registration.app, registration.service)
    except registry.NotConfigured as error:
        return [SendResult(Outcome.FAILED, error_code=error.code)] * len(group)
    wakeups = [_wakeup(registration, job) for registration, job in group]
    target = limits.Target(
        registration.app_id, registration.service, registration.app.updated.isoformat()
    )
    try:
        with metrics.sending(registration.service, len(wakeups)):
            return limits.send_group(provider, wakeups, target)
    except Exception as error:  # a provider must classify; a crash is treated as passing trouble
        log.exception("delivery.provider_crashed", extra={"error_type": type(error).__name__})
        return [SendResult(Outcome.RETRY_LATER, error_code="INTERNAL")] * len(group)


def _send_groups(
    groups: list[list[tuple[Registration, queue.SendJob]]],
) -> list[list[SendResult]]:
    """The groups of a batch (one per app and service) go out side by side, the first in this
    thread and each other one in a thread of its own: one app's stuck provider must not hold
    another app's wake-ups back, neither in this batch nor, through a shared pool, in others.
    """
    results: list[list[SendResult]] = [[] for _ in groups]

    def send(index: int) -> None:
        try:
            results[index] = _send_group(groups[index])
        except Exception as error:  # never lose a group's results to a crash: retry them
            log.exception("delivery.group_crashed", extra={"error_type": type(error).__name__})
            results[index] = [SendResult(Outcome.RETRY_LATER, "INTERNAL")] * len(groups[index])

    others = [
        threading.Thread(target=send, args=(index,), name="send-group", daemon=True)
        for index in range(1, len(groups))
    ]
    for thread in others:
        thread.start()
    if groups:
        send(0)
    for thread in others:
        thread.join()
    return results


def _claim_folded(registration: Registration, job: queue.SendJob) -> queue.SendJob:
    """A coalesced send carries what was folded into it: the latest counts, and important if
    any folded publish was. Claimed once; a redelivered copy sends its own values."""
    taken = throttling.take(registration=registration, push_id=job.push_id)
    if taken is None:
        return job
    return dataclasses.replace(
        job,
        important=taken.important or job.important,
        message_count=(
            taken.message_count if taken.message_count is not None else job.message_count
        ),
        pending_subscription_count=(
            taken.pending_subscription_count
            if taken.pending_subscription_count is not None
            else job.pending_subscription_count
        ),
        folded=taken.folded,
    )


def _retry_cap() -> float:
    return conf.current().send_retry_max_seconds


def busy_delay(age: float) -> float:
    """Seconds before a send deferred because its app's threads or slots were all busy is
    tried again: short at first (a healthy app that was merely busy), longer the longer the
    push has waited (a stuck app's pushes must not spin through the broker)."""
    return random.uniform(0.5, 1.0) * min(_retry_cap(), max(0.2, age / 2))


def _retry(
    registration: Registration,
    job: queue.SendJob,
    result: SendResult,
    now: datetime,
    book: Bookkeeping,
) -> str:
    """Defer the next attempt (a row in the batch's bookkeeping, relay/services/deferred.py);
    "" if deferred, else why the push is given up.

    A send deferred for lack of a thread or slot of its app (limits.BUSY_CODES) never reached
    the provider: it keeps its attempt number, so only the age limit ends it.
    """
    code = result.error_code or "RETRY_LATER"
    age = _age_seconds(job, now)
    attempt = job.attempt
    if code in limits.BUSY_CODES:
        delay = max(busy_delay(age), min(result.retry_after or 0.0, _retry_cap()))
    elif job.attempt >= conf.current().send_max_attempts:
        return f"retries exhausted: {code}"
    else:
        delay = retry_delay(job.attempt, result.retry_after, quota=code in QUOTA_CODES)
        attempt += 1
    if age + delay >= conf.current().send_max_age_seconds:
        return f"too old: {code}"
    book.deferred.append(
        deferred.row(
            dataclasses.replace(job, attempt=attempt, coalesced=False),
            delay,
            tenant_id=registration.app.tenant_id,
            app_id=registration.app_id,
            now=now,
        )
    )
    log.info(
        "delivery.retry_scheduled",
        extra={
            "push_id": job.push_id,
            "attempt": job.attempt,
            "code": code,
            "delay": round(delay, 3),
        },
    )
    return ""


class DatabaseUnavailable(Exception):
    """The database did not answer within DATABASE_RETRY_SECONDS, on fresh connections."""


@dataclass
class Bookkeeping:
    """What a batch taught: dead registrations, delivered ones whose `last_push` is due to move,
    dead letters, deferred retries and the Delivery rows, written in one transaction. Plain
    JSON-able data without token, JID or body, so that it can wait in the broker while the
    database is away."""

    at: str
    dead: list[int] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    deliveries: list[dict[str, Any]] = field(default_factory=list)
    deferred: list[dict[str, Any]] = field(default_factory=list)  # retries: deferred.row()

    def to_message(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> Bookkeeping:
        names = {item.name for item in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in message.items() if key in names})


class RecordPending(Exception):
    """The sends are done but their bookkeeping could not be written: it must be kept
    elsewhere (the broker) before the batch is acknowledged."""

    def __init__(self, bookkeeping: Bookkeeping, outcomes: list[Outcome]) -> None:
        super().__init__("bookkeeping not written")
        self.bookkeeping = bookkeeping
        self.outcomes = outcomes


_CONNECTION_ERRORS = (OperationalError, InterfaceError)


def with_database(operation: Callable[[], T]) -> T:
    """`operation()`, retried on a new connection while the database does not answer, for up to
    DATABASE_RETRY_SECONDS; then DatabaseUnavailable.

    A server restart kills every pooled connection; a worker thread would otherwise keep its
    dead one (CELERY_DB_REUSE_MAX) and fail every task with "the connection is closed".
    """
    deadline = time.monotonic() + conf.current().database_retry_seconds
    pause = 0.05
    while True:
        try:
            return operation()
        except _CONNECTION_ERRORS as error:
            with contextlib.suppress(DatabaseError):
                connection.close()  # the next query opens a new one
            if time.monotonic() + pause > deadline:
                log.warning(
                    "delivery.database_unavailable", extra={"error_type": type(error).__name__}
                )
                raise DatabaseUnavailable(type(error).__name__) from error
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def database_retry_delay(retries: int) -> float:
    """Seconds before a message the database turned away is tried again (its `retries`th
    time): the send backoff, at most DATABASE_RETRY_MAX_SECONDS."""
    return min(DATABASE_RETRY_MAX_SECONDS, retry_delay(retries + 1, None))


DATABASE_RETRY_MAX_SECONDS = 30.0


def deliver(job: queue.SendJob) -> Outcome:
    """Send one queued push and act on its outcome (a batch of one)."""
    return deliver_many([job])[0]


@functools.cache
def _registrations_sql() -> tuple[str, tuple[str, ...]]:
    """The batch's registrations by id, every column in the model's order, and their apps'
    `updated` (which App version is current), written once: compiling the ORM query cost as
    much as running it for a batch of one."""
    quote = connection.ops.quote_name
    fields = Registration._meta.concrete_fields
    columns = tuple(field.attname for field in fields)
    selected = ", ".join(f"r.{quote(str(field.column))}" for field in fields)
    registrations = quote(Registration._meta.db_table)
    apps = quote(App._meta.db_table)
    return (
        f"SELECT {selected}, a.{quote('updated')} FROM {registrations} r "
        f"JOIN {apps} a ON a.{quote('id')} = r.{quote('app_id')} WHERE r.{quote('id')} IN ",
        columns,
    )


def _aware(value: Any) -> Any:
    """SQLite gives a raw cursor naive UTC times."""
    if isinstance(value, datetime) and timezone.is_naive(value):
        return timezone.make_aware(value, UTC)
    return value


def _registration(columns: tuple[str, ...], row: tuple[Any, ...]) -> Registration:
    """A Registration from a raw row."""
    return Registration.from_db(connection.alias, columns, [_aware(value) for value in row])


def _load_registrations(ids: set[int]) -> dict[int, Registration]:
    """The batch's registrations with their apps: one query, plus one for the apps that are
    new to this process or changed since it loaded them (provider_registry.apps)."""
    sql, columns = _registrations_sql()
    with connection.cursor() as cursor:
        cursor.execute(sql + f"({', '.join(['%s'] * len(ids))})", sorted(ids))
        rows = cursor.fetchall()
    registrations: dict[int, Registration] = {}
    versions: dict[int, datetime] = {}
    for row in rows:
        registration = _registration(columns, row[:-1])
        registrations[registration.pk] = registration
        versions[registration.app_id] = _aware(row[-1])
    return _with_apps(registrations, versions)


def _read_already(known: dict[int, Registration]) -> dict[int, Registration]:
    """Registrations the caller read moments ago (the gateway's lookup, every column, and
    its app's `updated`): copies with their apps, without reading them again."""
    registrations = {pk: copy.copy(registration) for pk, registration in known.items()}
    versions = {r.app_id: r.app.updated for r in known.values()}
    return _with_apps(registrations, versions)


def _with_apps(
    registrations: dict[int, Registration], versions: dict[int, datetime]
) -> dict[int, Registration]:
    apps = registry.apps(versions)
    for registration in list(registrations.values()):
        app = apps.get(registration.app_id)
        if app is None:  # deleted meanwhile, and its registrations with it
            del registrations[registration.pk]
        else:
            registration.app = app
    return registrations


def deliver_many(
    jobs: list[queue.SendJob],
    *,
    registrations: dict[int, Registration] | None = None,
    keep: Callable[[Bookkeeping], bool] | None = None,
) -> list[Outcome]:
    """Send a batch of queued pushes; one outcome per job, in order.

    Each job ends exactly as `deliver` alone would end it (retried with its own backoff and
    push id, dead-lettered, recorded), but the batch shares its queries: the registrations in
    two, the sends grouped per app and service (the groups side by side, the provider may
    overlap a group's sends), the dead tokens, `last_push`, the dead letters and the Delivery
    rows in one statement each.

    `registrations`: the jobs' registrations by id as the caller just read them (every
    column, and the app's `updated`), instead of reading them here. `keep`: a journal that
    may keep the bookkeeping to write it later (relay/services/delivery_journal.py); False
    when it did not, and it is written here.

    Raises DatabaseUnavailable before anything was sent, RecordPending after.
    """
    if not jobs:
        return []
    outcomes: list[Outcome] = [Outcome.FAILED] * len(jobs)
    known = registrations
    registrations = with_database(
        lambda: (
            _load_registrations({job.registration_id for job in jobs})
            if known is None
            else _read_already(known)
        )
    )
    now = timezone.now()
    max_age = conf.current().send_max_age_seconds
    items: list[tuple[int, Registration, queue.SendJob]] = []
    results: dict[int, SendResult] = {}
    groups: dict[tuple[int, str], list[tuple[int, Registration, queue.SendJob]]] = {}
    for index, job in enumerate(jobs):
        registration = registrations.get(job.registration_id)
        if registration is None:
            log.info("delivery.registration_gone", extra={"push_id": job.push_id})
            continue
        if job.coalesced and job.attempt == 1:
            job = _claim_folded(registration, job)
        items.append((index, registration, job))
        if registration.dead_since is not None:
            results[index] = SendResult(Outcome.DEAD_TOKEN, error_code="ALREADY_DEAD")
        elif _age_seconds(job, now) >= max_age:
            results[index] = SendResult(Outcome.FAILED, error_code=TOO_OLD)
        else:
            key = (registration.app_id, registration.service)
            groups.setdefault(key, []).append((index, registration, job))
    sent = _send_groups(
        [[(registration, job) for _, registration, job in group] for group in groups.values()]
    )
    for group, group_results in zip(groups.values(), sent, strict=True):
        for (index, _, _), result in zip(group, group_results, strict=True):
            results[index] = result

    now = timezone.now()
    book = Bookkeeping(at=now.isoformat())
    for index, registration, job in items:
        result = results[index]
        given_up = ""
        if result.outcome == Outcome.RETRY_LATER:
            given_up = _retry(registration, job, result, now, book)
            if not given_up:
                outcomes[index] = Outcome.RETRY_LATER
                _count_retry(registration.service, result.error_code or "RETRY_LATER")
                continue
            result = SendResult(Outcome.FAILED, error_code=result.error_code or "RETRY_LATER")
        elif result.error_code == TOO_OLD:
            given_up = "too old: not sent"
        elif result.outcome == Outcome.FAILED:
            given_up = f"failed: {result.error_code or 'UNKNOWN'}"
        if result.outcome == Outcome.DEAD_TOKEN:
            book.dead.append(registration.pk)
        if result.outcome == Outcome.DELIVERED and _last_push_due(registration, now):
            book.delivered.append(registration.pk)
        if given_up:
            book.dead_letters.append(_dead_letter(registration, job, given_up))
        book.deliveries.append(_row(registration, job, result, now))
        outcomes[index] = result.outcome
        _count_outcome(registration.service, job, result, given_up, now)
        log.info(
            "delivery.done",
            extra={
                "push_id": job.push_id,
                "provider": registration.service,
                "outcome": result.outcome.value,
                "code": result.error_code,
                "attempt": job.attempt,
                "coalesced": job.folded,
                "dead_letter": bool(given_up),
            },
        )
    try:
        if keep is None or not keep(book):
            record(book)
    except DatabaseUnavailable:
        raise RecordPending(book, outcomes) from None
    return outcomes


def _last_push_due(registration: Registration, now: datetime) -> bool:
    """Whether a delivery moves `last_push` (kept to LAST_PUSH_RESOLUTION_SECONDS): most
    sends to a busy device do not, and then need no UPDATE at all."""
    last = registration.last_push
    return last is None or last < now - timedelta(seconds=LAST_PUSH_RESOLUTION_SECONDS)


def _count_retry(provider: str, code: str) -> None:
    metrics.SENDS.labels(provider, Outcome.RETRY_LATER.value).inc()
    kind = metrics.retry_kind(code, busy=code in limits.BUSY_CODES, quota=code in QUOTA_CODES)
    metrics.RETRIES.labels(provider, kind).inc()


def _count_outcome(
    provider: str, job: queue.SendJob, result: SendResult, given_up: str, now: datetime
) -> None:
    """A push's final outcome; a delivered one's time since its publish (or replay)."""
    metrics.SENDS.labels(provider, result.outcome.value).inc()
    if result.outcome == Outcome.DELIVERED:
        metrics.PUSH_LATENCY.labels(provider).observe(max(0.0, _age_seconds(job, now)))
    if given_up:
        metrics.DEAD_LETTERS.labels(provider, metrics.dead_letter_kind(given_up)).inc()


TOO_OLD = "TOO_OLD"
# What a dead letter written again (a replay failing again) takes from the new one.
DEAD_LETTER_FIELDS = ["tenant", "app", "registration", "provider", "reason", "attempts", "job"]


def record(book: Bookkeeping) -> None:
    """Write a batch's bookkeeping (retried on new connections; DatabaseUnavailable)."""
    if book.dead or book.delivered or book.dead_letters or book.deliveries or book.deferred:
        with_database(lambda: _write(book))


def record_kept(book: Bookkeeping) -> None:
    """`record` bookkeeping kept a while (a gateway's journal): what its rows name may have
    been deleted meanwhile. A row then keeps no registration that is gone (as deleting the
    registration would have left it) and goes with an app that is gone (as deleting the app
    would have taken it)."""
    try:
        record(book)
    except IntegrityError:
        record(with_database(lambda: _still_named(book)))


def _still_named(book: Bookkeeping) -> Bookkeeping:
    registrations = set(
        Registration.objects.filter(
            pk__in={row["registration_id"] for row in book.deliveries} | set(book.delivered)
        ).values_list("pk", flat=True)
    )
    apps = set(
        App.objects.filter(pk__in={row["app_id"] for row in book.deliveries}).values_list(
            "pk", flat=True
        )
    )
    rows = [
        {
            **row,
            "registration_id": row["registration_id"]
            if row["registration_id"] in registrations
            else None,
        }
        for row in book.deliveries
        if row["app_id"] in apps
    ]
    log.warning(
        "delivery.kept_rows_orphaned",
        extra={"rows": len(book.deliveries), "kept": len(rows)},
    )
    return dataclasses.replace(
        book,
        delivered=[pk for pk in book.delivered if pk in registrations],
        deliveries=rows,
    )


def _write(book: Bookkeeping) -> None:
    now = datetime.fromisoformat(book.at)
    stale = now - timedelta(seconds=LAST_PUSH_RESOLUTION_SECONDS)
    if (
        connection.vendor == "postgresql"
        and not book.dead
        and not book.dead_letters
        and not book.deferred
        and not connection.in_atomic_block
        and not connection.settings_dict["OPTIONS"].get("server_side_binding")
    ):
        # The everyday batch (sent, recorded): its statements in ONE round trip. Several
        # statements in one simple query (psycopg's client-side binding sends one) are one
        # implicit transaction on PostgreSQL, all or nothing, and SET LOCAL holds for it;
        # BEGIN, SET, INSERT and COMMIT apart would be four round trips per message.
        # Its text is one of four, whatever the batch holds (`_record_statement`): psycopg
        # caches the parsing of a short statement's text only.
        adapt = connection.ops.adapt_datetimefield_value
        parts: list[tuple[str, list[Any]]] = [("SET LOCAL synchronous_commit TO OFF", [])]
        if book.delivered:
            parts.append((_MOVE_LAST_PUSH_SQL, [adapt(now), book.delivered, adapt(stale)]))
        if book.deliveries:
            parts.append(_record_statement(book.deliveries))
        with connection.cursor() as cursor:
            cursor.execute("; ".join(sql for sql, _ in parts), [v for _, vs in parts for v in vs])
        return
    with _bookkeeping(durable=bool(book.dead_letters or book.deferred)):
        deferred.write(book.deferred)
        if book.dead:
            _update_registrations(book.dead, "dead_since", now, "dead_since IS NULL")
            lifecycle.died(book.dead, at=now)
        if book.delivered:
            _update_registrations(book.delivered, "last_push", now, _STALE_PUSH, stale)
        if book.dead_letters:
            DeadLetter.objects.bulk_create(
                [DeadLetter(**letter, replayed=None) for letter in book.dead_letters],
                update_conflicts=True,
                unique_fields=["push_id"],
                update_fields=[*DEAD_LETTER_FIELDS, "replayed"],
            )
        _record(book.deliveries)


def _update_registrations(
    ids: list[int], column: str, value: datetime, condition: str, *times: datetime
) -> None:
    with connection.cursor() as cursor:
        cursor.execute(*_update_sql(ids, column, value, condition, *times))


_STALE_PUSH = "(last_push IS NULL OR last_push < %s)"
_MOVE_LAST_PUSH_SQL = (
    f'UPDATE "{Registration._meta.db_table}" SET last_push = %s '
    f"WHERE id = ANY(%s) AND {_STALE_PUSH}"
)


def _update_sql(
    ids: list[int], column: str, value: datetime, condition: str, *times: datetime
) -> tuple[str, list[Any]]:
    """`UPDATE registration SET column = value WHERE id IN ids AND condition`, written out:
    compiling the ORM's update took more time than running it. `times` fill the condition's
    placeholders; times are adapted as the ORM would (SQLite stores naive UTC text)."""
    adapt = connection.ops.adapt_datetimefield_value
    table = connection.ops.quote_name(Registration._meta.db_table)
    sql = (
        f"UPDATE {table} SET {column} = %s "
        f"WHERE id IN ({', '.join(['%s'] * len(ids))}) AND {condition}"
    )
    return sql, [adapt(value), *ids, *(adapt(moment) for moment in times)]


@contextlib.contextmanager
def _bookkeeping(*, durable: bool) -> Iterator[None]:
    """One commit for what a batch learnt, and on PostgreSQL without waiting for the WAL
    flush: a commit per statement was what bounded single sends. These rows are bookkeeping;
    a crash may lose the last few, and a dead token lost so is learnt again at the next send.

    Not so a dead letter or a deferred send: it is the only copy of its push (the broker
    message is acknowledged next), so a batch that writes one waits for the flush.
    """
    with transaction.atomic():
        if connection.vendor == "postgresql" and not durable:
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
        yield


def bury(jobs: list[queue.SendJob], reason: str) -> int:
    """Keep jobs the broker gave up on (past its delivery limit) as dead letters, durably;
    returns how many. A job whose registration is gone has nothing left to send to."""
    registrations = Registration.objects.select_related("app").in_bulk(
        [job.registration_id for job in jobs]
    )
    letters = [
        _dead_letter(registrations[job.registration_id], job, reason)
        for job in jobs
        if job.registration_id in registrations
    ]
    with _bookkeeping(durable=True):
        DeadLetter.objects.bulk_create(
            [DeadLetter(**letter, replayed=None) for letter in letters],
            update_conflicts=True,
            unique_fields=["push_id"],
            update_fields=[*DEAD_LETTER_FIELDS, "replayed"],
        )
    return len(letters)


def _dead_letter(registration: Registration, job: queue.SendJob, reason: str) -> dict[str, Any]:
    """Keep the job (it holds no token, JID or body) for a replay with the same push id."""
    log.warning(
        "delivery.dead_letter",
        extra={"push_id": job.push_id, "provider": registration.service, "reason": reason},
    )
    return {
        **_whose(registration, job),
        "reason": reason[:64],
        "attempts": job.attempt,
        "job": job.to_message(),
    }


def _whose(registration: Registration, job: queue.SendJob) -> dict[str, Any]:
    """The fields a Delivery row and a dead letter share: which push, whose, through what."""
    return {
        "push_id": job.push_id,
        "tenant_id": registration.app.tenant_id,
        "app_id": registration.app_id,
        "registration_id": registration.pk,
        "provider": registration.service,
    }


def _row(
    registration: Registration, job: queue.SendJob, result: SendResult, now: datetime
) -> dict[str, Any]:
    """A Delivery row's fields, JSON-able (times as ISO text, which the fields parse)."""
    return {
        **_whose(registration, job),
        "publishing_domain": job.publishing_domain,
        "priority": Priority.HIGH if job.important else Priority.NORMAL,
        "received": job.received,
        "queued": job.queued or now.isoformat(),
        "sent": now.isoformat() if result.outcome == Outcome.DELIVERED else None,
        "attempts": job.attempt,
        "outcome": result.outcome,
        "error_code": result.error_code[:64],
        "coalesced": job.folded,
    }


_DELIVERY_FIELDS = (
    "push_id",
    "tenant",
    "app",
    "registration",
    "provider",
    "publishing_domain",
    "priority",
    "received",
    "queued",
    "sent",
    "attempts",
    "outcome",
    "error_code",
    "coalesced",
)
# The first record's priority and coalesced count stay: a redelivered copy of a coalesced
# send no longer knows what was folded into it.
_DELIVERY_UPDATED = ("sent", "attempts", "outcome", "error_code")
_DELIVERY_TIMES = frozenset({"received", "queued", "sent"})


def _record(rows: list[dict[str, Any]]) -> None:
    if rows:
        with connection.cursor() as cursor:
            cursor.execute(*_record_statement(rows))


def _record_statement(rows: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    """The rows' INSERT: on PostgreSQL one text whatever their number (the rows as one JSON
    parameter), whose parsing psycopg caches; a VALUES list elsewhere."""
    if connection.vendor == "postgresql":
        return _record_json_sql(), [json.dumps(rows, default=str)]
    return _record_sql(rows)


@functools.cache
def _record_json_sql() -> str:
    """`_record_sql` on PostgreSQL with the rows as one JSON array (one parameter), each
    value cast to its column's type by `jsonb_to_recordset`."""
    quote = connection.ops.quote_name
    fields = [cast(Field, Delivery._meta.get_field(name)) for name in _DELIVERY_FIELDS]

    def kind(field: Field) -> str:
        # Text as text: the INSERT's own cast then refuses a value too long, as it does a
        # VALUES list's (a varchar(n) here would cut it short silently).
        return (
            "text" if field.get_internal_type() == "CharField" else str(field.db_type(connection))
        )

    columns = ", ".join(quote(str(field.column)) for field in fields)
    record = ", ".join(f"{quote(field.attname)} {kind(field)}" for field in fields)
    selected = ", ".join(quote(field.attname) for field in fields)
    updates = ", ".join(f"{quote(name)} = EXCLUDED.{quote(name)}" for name in _DELIVERY_UPDATED)
    return (
        f"INSERT INTO {quote(Delivery._meta.db_table)} ({columns}) "
        f"SELECT {selected} FROM jsonb_to_recordset(%s::jsonb) AS r({record}) "
        f"ON CONFLICT ({quote('push_id')}) DO UPDATE SET {updates}"
    )


def _record_sql(rows: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    """One row per push id: a redelivered or replayed push updates its row, never adds one.
    One multi-row INSERT ... ON CONFLICT, without building a model instance per row or
    compiling the query. The values are the rows' own (ids, text, counts), the times parsed
    from their ISO text and adapted as the model's fields adapt them: running every value
    through `Field.get_db_prep_save` (as bulk_create does) would be a large part of writing
    the rows.
    """
    columns_of = [Delivery._meta.get_field(name) for name in _DELIVERY_FIELDS]
    names = [str(column.attname) for column in columns_of]  # type: ignore[union-attr]
    # The wrapper itself: every attribute read through `django.db.connection` (a proxy to the
    # thread's connection) costs an asgiref lookup, and the loop below reads it per value.
    database = connections[DEFAULT_DB_ALIAS]
    adapt_time = database.ops.adapt_datetimefield_value
    push_id = Delivery._meta.get_field("push_id")  # a uuid, or 32 hex digits on SQLite
    params: list[Any] = []
    for row in rows:
        for name in names:
            value = row[name]
            if name == "push_id":
                value = push_id.get_db_prep_save(value, database)
            elif isinstance(value, enum.Enum):  # an Outcome: its value, as the model stores it
                value = value.value
            elif name in _DELIVERY_TIMES and value is not None:
                moment = datetime.fromisoformat(value) if isinstance(value, str) else value
                value = adapt_time(moment)
            params.append(value)
    quote = database.ops.quote_name
    columns = ", ".join(quote(str(column.column)) for column in columns_of)  # type: ignore[union-attr]
    placeholders = "(" + ", ".join(["%s"] * len(columns_of)) + ")"
    updates = ", ".join(f"{quote(name)} = EXCLUDED.{quote(name)}" for name in _DELIVERY_UPDATED)
    sql = (
        f"INSERT INTO {quote(Delivery._meta.db_table)} ({columns}) VALUES "
        f"{', '.join([placeholders] * len(rows))} "
        f"ON CONFLICT ({quote('push_id')}) DO UPDATE SET {updates}"
    )
    return sql, params
