"""Gauges read from the database and the broker when /metrics is scraped (relay/metrics.py).

Counters live in the processes that count; what is stored (registrations, credentials, dead
letters, the queue) is read here, in the web process only, so that a dashboard summing over
processes counts it once. Each part that fails (the database or the broker is down) is left
out and `relay_state_up{source}` says so; a scrape never fails for it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import current_app as celery_app
from django.db import DatabaseError
from django.db.models import Count, Q
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric

from relay import features
from relay.models import App, DeadLetter, ProviderCredentials, Registration, Tenant
from relay.services import deferred

log = logging.getLogger(__name__)


def _app_names() -> dict[int, tuple[str, str]]:
    return {
        pk: (tenant, name)
        for pk, tenant, name in App.objects.values_list("pk", "tenant__name", "name")
    }


def _registrations(apps: dict[int, tuple[str, str]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "relay_registrations",
        "Registrations stored, by tenant, app, provider and state (live, dead).",
        labels=["tenant", "app", "provider", "state"],
    )
    rows = Registration.objects.values("app_id", "service").annotate(
        live=Count("pk", filter=Q(dead_since__isnull=True)),
        dead=Count("pk", filter=Q(dead_since__isnull=False)),
    )
    for row in rows:
        tenant, app = apps.get(row["app_id"], ("", str(row["app_id"])))
        family.add_metric([tenant, app, row["service"], "live"], row["live"])
        family.add_metric([tenant, app, row["service"], "dead"], row["dead"])
    return family


def _credential_expiry() -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "relay_credential_expiry_seconds",
        "Seconds until a provider credential expires (negative: expired), by tenant and app.",
        labels=["tenant", "app", "credential"],
    )
    now = timezone.now()
    rows = ProviderCredentials.objects.filter(not_after__isnull=False).values_list(
        "app__tenant__name", "app__name", "service", "not_after"
    )
    for tenant, app, service, not_after in rows:
        if not_after is None:  # filtered out above; the type cannot know it
            continue
        family.add_metric(
            [tenant, app, f"{service}_certificate"], round((not_after - now).total_seconds())
        )
    return family


def _dead_letters_pending(apps: dict[int, tuple[str, str]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "relay_dead_letters_pending",
        "Dead letters not yet replayed, by tenant, app and provider.",
        labels=["tenant", "app", "provider"],
    )
    rows = (
        DeadLetter.objects.filter(replayed__isnull=True)
        .values("app_id", "provider")
        .annotate(count=Count("pk"))
    )
    for row in rows:
        tenant, app = apps.get(row["app_id"], ("", str(row["app_id"])))
        family.add_metric([tenant, app, row["provider"]], row["count"])
    return family


def _deferred() -> list[Metric]:
    """The deferred sends waiting in the database (relay/services/deferred.py), by tenant and
    whether they are due; and how long the oldest due one is overdue (grows when no worker
    sweeps or the sweeps cannot keep up)."""
    backlog = deferred.backlog()
    names = dict(Tenant.objects.filter(pk__in=backlog.waiting).values_list("pk", "name"))
    waiting = GaugeMetricFamily(
        "relay_deferred_sends",
        "Sends deferred in the database (retries, coalescing windows), by tenant and state "
        "(due: waiting for the sweep; later: not due yet).",
        labels=["tenant", "state"],
    )
    for tenant, count in backlog.waiting.items():
        due = backlog.due.get(tenant, 0)
        waiting.add_metric([names.get(tenant, str(tenant)), "due"], due)
        waiting.add_metric([names.get(tenant, str(tenant)), "later"], count - due)
    overdue = GaugeMetricFamily(
        "relay_deferred_oldest_due_seconds",
        "How long the oldest due deferred send has waited past its due time (0: none).",
    )
    overdue.add_metric([], round(backlog.oldest_due_seconds, 3))
    return [waiting, overdue]


# kombu's SQLAlchemy transport (the embedded defaults' broker) gives each channel a session
# it never closes, holding a pooled connection until the channel is collected: a depth read
# every second (each worker's sweeper) would drain the pool the worker consumes through. On
# that transport one connection per process is kept for these reads.
_kept_read: Any = None
_kept_lock = threading.Lock()


def _message_count(conn: Any) -> int:
    from kombu.exceptions import ChannelError

    conn.ensure_connection(max_retries=1, timeout=2)
    try:
        return int(
            conn.default_channel.queue_declare(
                queue=celery_app.conf.task_default_queue, passive=True
            ).message_count
        )
    except ChannelError:  # the queue does not exist yet: nothing was ever sent
        return 0


def queue_depth() -> int:
    """Sends waiting in the broker for a worker (not those a worker holds for a countdown)."""
    global _kept_read
    conn = celery_app.connection_for_read()
    if conn.transport.driver_type != "sql":
        with conn:
            return _message_count(conn)
    conn.release()
    with _kept_lock:
        if _kept_read is None:
            _kept_read = celery_app.connection_for_read()
        try:
            return _message_count(_kept_read)
        except Exception:
            _kept_read.release()
            _kept_read = None
            raise


def read_state() -> list[Metric]:
    """The stored state as metric families; what cannot be read is left out."""
    families: list[Metric] = []
    up = GaugeMetricFamily(
        "relay_state_up",
        "1 when /metrics could read a source of the stored state (database, broker), else 0.",
        labels=["source"],
    )
    try:
        apps = _app_names()
        families += [_registrations(apps), _credential_expiry(), _dead_letters_pending(apps)]
        families += _deferred()
        for part in features.state_metrics():  # the feature apps' (relay.features)
            families += part.read()
        up.add_metric(["database"], 1)
    except DatabaseError as error:
        log.warning("metrics.database_unavailable", extra={"error_type": type(error).__name__})
        up.add_metric(["database"], 0)
    try:
        depth = queue_depth()
        family = GaugeMetricFamily(
            "relay_queue_depth", "Messages waiting in the broker's queue.", labels=["queue"]
        )
        family.add_metric([celery_app.conf.task_default_queue], depth)
        families.append(family)
        up.add_metric(["broker"], 1)
    except Exception as error:  # kombu, amqp and socket errors: the broker is unreachable
        log.warning("metrics.broker_unavailable", extra={"error_type": type(error).__name__})
        up.add_metric(["broker"], 0)
    families.append(up)
    return families
