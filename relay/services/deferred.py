"""Deferred sends: kept in the database until due, then published to the broker by a sweep.

A send is put off when its provider is down or refuses (a retry with backoff, Retry-After,
a quota), when its app's threads are all busy, or when burst coalescing gives it a window
(relay/services/throttling/). A countdown in the broker would hold each of these as a
message of its own: a provider outage defers tens of thousands at once, which on RabbitMQ's
quorum queues go through Celery's delayed delivery (about 8 ms of broker CPU each, and
celery#9912: countdown tasks stuck in its delay queues), and on Redis are held in worker
memory. Here they are rows (`DeferredSend`), one per push id.

The sweep (every worker's, relay/services/worker_sweeps.py, every RELAY_DEFERRED_SWEEP_SECONDS)
takes due rows, publishes them (one relay.send_pushes message per app) and deletes them in ONE
transaction, after the broker confirmed: a crash between publish and commit leaves the rows,
which the next sweep publishes again (at least once; the push id keeps the Delivery row and
the provider's id single), and a broker that is down rolls the sweep back (nothing lost).
On PostgreSQL the rows are taken FOR UPDATE SKIP LOCKED, so sweeps running side by side
(several workers' at once) take different rows; SQLite serialises writers anyway.

Fairness: fresh pushes never pass through the table. A sweep publishes at most
RELAY_DEFERRED_SWEEP_BATCH rows, shared out evenly between the tenants that have due rows, and
none while more than RELAY_DEFERRED_QUEUE_LIMIT messages wait in the send queue (but for a
few rows overdue by more than STARVED_AFTER_SECONDS, so that a queue that stays busy never
starves them): 20,000 deferred pushes of one tenant go out at a bounded rate, only as fast as
the workers take them, so other tenants' fresh pushes never queue behind them (the queue is
first in, first out), and one tenant's backlog cannot starve another's retries.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import BooleanField, Case, Count, Min, Q, Value, When
from django.utils import timezone

from relay import conf, metrics
from relay.models import DeferredSend
from relay.services import queue

log = logging.getLogger(__name__)

# Jobs per broker message when a sweep publishes an app's due sends: few, because a worker
# prefetches messages and runs them in order; a fresh push taken after a few of the backlog's
# messages must not wait for hundreds of its sends.
MESSAGE_JOBS = 10
# While the queue is busy a sweep still publishes the rows overdue longer than this, at most
# 1/HELD_SHARE of its batch: a queue that stays busy (one tenant keeping every worker thread
# taken) delays the deferred sends, it never holds them until their age limit ends them.
STARVED_AFTER_SECONDS = 30.0
HELD_SHARE = 20


def row(
    job: queue.SendJob, delay: float, *, tenant_id: int, app_id: int, now: datetime
) -> dict[str, Any]:
    """A deferred send's fields, JSON-able (it may wait in the broker inside a batch's
    bookkeeping while the database is away: relay/services/delivery.py)."""
    return {
        "push_id": job.push_id,
        "tenant_id": tenant_id,
        "app_id": app_id,
        "due": (now + timedelta(seconds=max(delay, 0.0))).isoformat(),
        "job": {**job.to_message(), "app": app_id},
    }


def write(rows: Iterable[dict[str, Any]]) -> int:
    """Keep deferred sends (inside the caller's transaction, if any). A push id deferred
    again (a redelivered batch) moves its row rather than doubling it."""
    objects = [
        DeferredSend(
            push_id=item["push_id"],
            tenant_id=item["tenant_id"],
            app_id=item["app_id"],
            due=datetime.fromisoformat(item["due"]),
            job=item["job"],
        )
        for item in rows
    ]
    if objects:
        DeferredSend.objects.bulk_create(
            objects,
            update_conflicts=True,
            unique_fields=["push_id"],
            update_fields=["due", "job", "tenant", "app"],
        )
        metrics.DEFERRED.inc(len(objects))
    return len(objects)


def defer(job: queue.SendJob, delay: float, *, tenant_id: int, app_id: int) -> None:
    """Keep one send for `delay` seconds from now; raises DatabaseError if not kept."""
    with transaction.atomic():
        write([row(job, delay, tenant_id=tenant_id, app_id=app_id, now=timezone.now())])


@dataclass(frozen=True, slots=True)
class Sweep:
    published: int
    tenants: int
    messages: int


def _take(limit: int, now: datetime) -> list[DeferredSend]:
    """Up to `limit` due rows, oldest first within a tenant, shared evenly between the tenants
    with due rows (a tenant with fewer leaves its share to the others; in random order, so
    that more tenants than `limit` take turns), locked until the transaction ends."""
    tenants = list(
        DeferredSend.objects.filter(due__lte=now)
        .order_by()
        .values_list("tenant_id", flat=True)
        .distinct()
    )
    random.shuffle(tenants)
    due = DeferredSend.objects.filter(due__lte=now).order_by("due", "pk")
    if connection.features.has_select_for_update_skip_locked:
        due = due.select_for_update(skip_locked=True, of=("self",))
    taken: list[DeferredSend] = []
    per_tenant: dict[int, list[int]] = {tenant: [] for tenant in tenants}
    while tenants and len(taken) < limit:
        share = max(1, math.ceil((limit - len(taken)) / len(tenants)))
        for tenant in list(tenants):
            room = min(share, limit - len(taken))
            if room <= 0:
                break
            rows = list(due.filter(tenant_id=tenant).exclude(pk__in=per_tenant[tenant])[:room])
            taken += rows
            per_tenant[tenant] += [row.pk for row in rows]
            if len(rows) < room:  # none left (or the rest held by another sweep)
                tenants.remove(tenant)
    return taken


def sweep(*, limit: int | None = None, now: datetime | None = None) -> Sweep:
    """Publish the due deferred sends (at most `limit`, default RELAY_DEFERRED_SWEEP_BATCH)
    and delete them, in one transaction; raises queue.QueueUnavailable (every row stays) when
    the broker does not take them. While the send queue is longer than
    RELAY_DEFERRED_QUEUE_LIMIT messages, only a few rows overdue for STARVED_AFTER_SECONDS."""
    limit = conf.current().deferred_sweep_batch if limit is None else limit
    now = now or timezone.now()
    due_by = now
    if _queue_busy():
        limit = max(1, limit // HELD_SHARE)
        due_by = now - timedelta(seconds=STARVED_AFTER_SECONDS)
    if not DeferredSend.objects.filter(due__lte=due_by).exists():
        # Most rounds of most workers: nothing is due, and no write lock is taken (SQLite's
        # transactions begin IMMEDIATE) nor held by a worker paused mid-sweep.
        return Sweep(0, 0, 0)
    with transaction.atomic():
        rows = _take(limit, due_by)
        if not rows:
            return Sweep(0, 0, 0)
        per_app: dict[int, list[queue.SendJob]] = {}
        for item in rows:
            per_app.setdefault(item.app_id, []).append(queue.SendJob.from_message(item.job))
        messages = 0
        for jobs in per_app.values():
            for start in range(0, len(jobs), MESSAGE_JOBS):
                queue.enqueue_sends(jobs[start : start + MESSAGE_JOBS])
                messages += 1
        DeferredSend.objects.filter(pk__in=[item.pk for item in rows]).delete()
    metrics.DEFERRED_PUBLISHED.inc(len(rows))
    swept = Sweep(len(rows), len({item.tenant_id for item in rows}), messages)
    log.info(
        "deferred.swept",
        extra={"published": swept.published, "tenants": swept.tenants, "messages": messages},
    )
    return swept


def _queue_busy() -> bool:
    """Whether fresh pushes wait in the broker: then the backlog must not queue ahead of
    them (the queue is first in, first out). Unknown (the broker did not answer) is not busy:
    the publish then says whether the broker takes anything."""
    ceiling = conf.current().deferred_queue_limit
    if ceiling <= 0:
        return False
    from relay.services import observability  # it reads this module's backlog for /metrics

    try:
        depth = observability.queue_depth()
    except Exception as error:  # kombu, redis, amqp and socket errors
        log.info("deferred.queue_depth_unknown", extra={"error_type": type(error).__name__})
        return False
    if depth > ceiling:
        metrics.DEFERRED_SWEEPS_HELD.inc()
        log.info("deferred.sweep_held", extra={"queue_depth": depth})
        return True
    return False


def sweep_due() -> int:
    """One sweep for a worker's sweeper: how many sends it queued; 0 when the broker refused
    (the rows stay for the next sweep, counted in relay_deferred_sweep_failures)."""
    try:
        return sweep().published
    except queue.QueueUnavailable:
        metrics.DEFERRED_SWEEP_FAILURES.inc()
        log.warning("deferred.sweep_failed")
        return 0


@dataclass(frozen=True, slots=True)
class Backlog:
    """What waits in the table: per tenant id, how many rows and how many are due; and
    how long the oldest due row is overdue (0: none is), which grows when sweeps lag."""

    waiting: dict[int, int]
    due: dict[int, int]
    oldest_due_seconds: float


def backlog(now: datetime | None = None) -> Backlog:
    now = now or timezone.now()
    waiting: dict[int, int] = {}
    due: dict[int, int] = {}
    for tenant, is_due, count in _counts(now):
        waiting[tenant] = waiting.get(tenant, 0) + count
        if is_due:
            due[tenant] = due.get(tenant, 0) + count
    oldest = DeferredSend.objects.filter(due__lte=now).aggregate(oldest=Min("due"))["oldest"]
    overdue = (now - oldest).total_seconds() if oldest is not None else 0.0
    return Backlog(waiting, due, max(0.0, overdue))


def _counts(now: datetime) -> list[tuple[int, bool, int]]:
    rows = (
        DeferredSend.objects.order_by()
        .annotate(
            is_due=Case(
                When(Q(due__lte=now), then=Value(True)),
                default=Value(False),
                output_field=BooleanField(),
            )
        )
        .values("tenant_id", "is_due")
        .annotate(count=Count("pk"))
    )
    return [(item["tenant_id"], bool(item["is_due"]), item["count"]) for item in rows]
