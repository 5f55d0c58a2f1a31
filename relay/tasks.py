"""Celery entry points: parse the message, call the delivery service, keep the message safe.

A send is acknowledged only after `deliver` returned (acks_late): a worker killed mid-send
leaves the message unacknowledged, and the broker hands it to another worker (RabbitMQ: once
the dead worker's connection closes; the embedded broker: once its lease expires). A send
delivered CELERY_DELIVERY_LIMIT times becomes a dead letter
(relay/services/broker_dead_letters.py). The redelivered job keeps its push id, so it is
told apart from a new push and its Delivery row is updated, not doubled. The same holds for
a batch message (relay.send_pushes): it comes back whole, and every push in it keeps its id.

A message is never acknowledged while what it carries exists nowhere else:

- the database does not answer before the sends (DatabaseUnavailable): the message goes back
  to the broker as a Celery retry with backoff, as often as it takes (the age limit turns a
  push that waited too long into a dead letter once the database is back);
- the database does not answer after the sends (RecordPending): their bookkeeping goes to the
  broker as a relay.record_outcomes message, retried the same way;
- the broker does not take either: the message is rejected with requeue, and if the broker
  is away for that too, it stays unacknowledged in the broker, which redelivers it once the
  connection it was delivered on is gone.

Celery's own retry turns a failed publish into a reject WITHOUT requeue; `_defer` catches that.

Only these database retries wait in the broker (a countdown): the database is what is missing.
A send deferred for its provider (outage, Retry-After, quota, busy app) or a coalescing window
waits in the database instead and is queued by the sweep every worker runs
(relay/services/worker_sweeps.py, relay/services/deferred.py): no other process is needed.
"""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any, NoReturn

from celery import Task, shared_task
from celery.exceptions import Reject
from celery.signals import (
    task_prerun,
    task_received,
    task_revoked,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from kombu.asynchronous import get_event_loop

from relay.providers.base import Outcome
from relay.services import broker_dead_letters, delivery, worker_sweeps
from relay.services import provider_limits as limits
from relay.services import provider_registry as registry
from relay.services.queue import SEND_PUSH, SEND_PUSHES, SendJob, apps_of

log = logging.getLogger(__name__)

SEND_TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "acks_late": True,
    "reject_on_worker_lost": True,
    "max_retries": None,  # database trouble is retried until it ends (see `_defer`)
}


@shared_task(name=SEND_PUSH, **SEND_TASK_OPTIONS)
def send_push(self: Task, message: dict[str, Any]) -> str:
    return _deliver(self, [message])[0].value


@shared_task(name=SEND_PUSHES, **SEND_TASK_OPTIONS)
def send_pushes(self: Task, messages: list[dict[str, Any]]) -> int:
    """A batch the gateway queued as one message: acknowledged once every job in it is done
    (sent, retried individually, or dead-lettered), so a killed worker redelivers all of it."""
    return len(_deliver(self, messages))


@shared_task(name="relay.record_outcomes", **SEND_TASK_OPTIONS)
def record_outcomes(self: Task, bookkeeping: dict[str, Any]) -> int:
    """What a batch's sends taught, kept in the broker while the database was away."""
    book = delivery.Bookkeeping.from_message(bookkeeping)
    try:
        delivery.record(book)
    except delivery.DatabaseUnavailable:
        _defer(self)
    return len(book.deliveries)


def _deliver(task: Task, messages: list[dict[str, Any]]) -> list[Outcome]:
    try:
        return delivery.deliver_many([SendJob.from_message(message) for message in messages])
    except delivery.DatabaseUnavailable:
        _defer(task)
    except delivery.RecordPending as pending:
        try:
            record_outcomes.apply_async(args=[pending.bookkeeping.to_message()])
        except Exception as error:  # kombu, amqp and socket errors: not queued
            # Keep the batch: sent again later with the same push ids (at-least-once).
            log.warning("delivery.record_not_queued", extra={"error_type": type(error).__name__})
            raise Reject(error, requeue=True) from error
        log.warning("delivery.record_queued", extra={"deliveries": len(pending.outcomes)})
        return pending.outcomes


def _defer(task: Task) -> NoReturn:
    """Hand the message back to the broker, to be tried again after a backoff."""
    countdown = delivery.database_retry_delay(task.request.retries)
    log.warning(
        "delivery.deferred",
        extra={"task": task.name, "retries": task.request.retries, "delay": round(countdown, 3)},
    )
    try:
        task.retry(countdown=countdown, max_retries=None)
    except Reject as refused:
        # Celery could not publish the retry and would drop the message: requeue it instead
        # (or, with the broker away, leave it unacknowledged there).
        raise Reject(refused.reason, requeue=True) from refused
    raise AssertionError("Task.retry returns only by raising")  # pragma: no cover


@worker_init.connect(weak=False)
def _note_worker_threads(sender: Any = None, **_: object) -> None:
    """The per-app thread limit follows the worker's thread count unless configured."""
    concurrency = getattr(sender, "concurrency", 0)
    if isinstance(concurrency, int):
        limits.set_worker_threads(concurrency)


@task_received.connect(weak=False)
def _note_waiting(request: Any = None, **_: object) -> None:
    """A send message now waits for a thread of this worker: its apps are counted, so that
    another app's sends beyond their share step aside for it (provider_limits)."""
    if request is None or request.eta:  # a countdown is not waiting for a thread yet
        return
    apps = apps_of(request.name, request.args)
    if apps:
        limits.task_waiting(request.id, apps)


@task_prerun.connect(weak=False)
def _note_started(task_id: str = "", **_: object) -> None:
    limits.task_started(task_id)


@task_revoked.connect(weak=False)
def _note_revoked(request: Any = None, **_: object) -> None:
    if request is not None:
        limits.task_started(request.id)


_probes: list[Any] = []


@worker_init.connect(weak=False)
def _start_probes(**_: object) -> None:
    """/healthz, /readyz (database and broker reachable) and /metrics of this worker."""
    from relay import conf
    from relay.probes import ProbeServer
    from relay.services import health

    probes = ProbeServer("worker", conf.current().worker_probe_listen, health.readiness)
    probes.start()
    _probes.append(probes)


@worker_shutdown.connect(weak=False)
def _stop_probes(**_: object) -> None:
    while _probes:
        _probes.pop().stop()


def _close_providers(**_: object) -> None:
    """Close provider connections when a worker stops cleanly (HTTP/2 goodbye to APNs)."""
    registry.close_all()


# prefork children get the first; the threads and solo pools only the second.
worker_process_shutdown.connect(_close_providers, weak=False)
worker_shutdown.connect(_close_providers, weak=False)


@worker_shutting_down.connect(weak=False)
def _wake_the_event_loop(**_: object) -> None:
    """Celery's SIGTERM handler runs on the event loop's own thread, whose poll then sleeps
    out its timeout (up to 10 s) before the loop sees the stop; a callback queued from another
    thread wakes it, so a worker stops as soon as its running sends are done."""
    hub = get_event_loop()
    if hub is not None:
        threading.Thread(target=hub.call_soon, args=(_nothing,), daemon=True).start()


def _nothing() -> None:
    pass


# A young collection after this many new container objects (CPython's default: 700), the
# middle one after 20 young ones and the oldest after 100 middle ones (default: 10 and 10).
# A batch of sends allocates thousands of short-lived objects, nearly all gone by its end: at
# the default a young pass ran several times per send and moved live ones on to the older
# generations, to be walked again (the collector's share of a worker's CPU and its figures:
# docs/benchmarks.md). Garbage in cycles waits for at most this many allocations longer.
COLLECTOR_THRESHOLDS = (20_000, 20, 100)


@worker_ready.connect(weak=False)
@worker_process_init.connect(weak=False)
def _freeze_the_loaded_heap(**_: object) -> None:
    """What the worker loaded (Django, Celery, the models, the providers' clients) lives as
    long as the process: out of the collector's passes, which otherwise walk it again and
    again while sends allocate (a worker's CPU per push: docs/benchmarks.md); and the passes
    spaced for a worker's allocations. A prefork child freezes what it inherited."""
    gc.freeze()
    gc.set_threshold(*COLLECTOR_THRESHOLDS)


@worker_ready.connect
def _declare_dead_letter_queue(**_: object) -> None:
    """Before any send can pass its delivery limit, the queue it is dead-lettered to exists."""
    broker_dead_letters.declare()


_sweepers: list[worker_sweeps.Sweeper] = []


def _forks_children(consumer: Any) -> bool:
    return type(getattr(consumer, "pool", None)).__module__.startswith("celery.concurrency.prefork")


@worker_ready.connect(weak=False)
def _start_sweeper(sender: Any = None, **_: object) -> None:
    """Each worker queues the due deferred sends and records the broker's dead letters
    itself (relay/services/worker_sweeps.py): no beat is needed for an accepted push.
    A prefork worker's children sweep instead (`_start_child_sweeper`): the parent forks a
    new child whenever one dies, and a sweeper thread of the parent could be holding a lock
    (a query, a pool) that the child would inherit held."""
    if not _forks_children(sender):
        _sweepers.append(worker_sweeps.Sweeper().start())


@worker_process_init.connect(weak=False)
def _start_child_sweeper(**_: object) -> None:
    _sweepers.append(worker_sweeps.Sweeper().start())


@worker_shutdown.connect(weak=False)
@worker_process_shutdown.connect(weak=False)
def _stop_sweeper(**_: object) -> None:
    while _sweepers:
        _sweepers.pop().stop()


@shared_task(name="relay.collect_broker_dead_letters", ignore_result=True)
def collect_broker_dead_letters() -> int:
    """Sends RabbitMQ dead-lettered, recorded as the relay's dead letters (the workers' sweeper
    runs this every 30 s; the task is for an operator's one-off run)."""
    return broker_dead_letters.collect()


@shared_task(name="relay.sweep_deferred_sends", ignore_result=True)
def sweep_deferred_sends() -> int:
    """Queue the deferred sends that are due (the workers' sweeper runs this every
    RELAY_DEFERRED_SWEEP_SECONDS; the task is for an operator's one-off run)."""
    from relay.services import deferred

    return deferred.sweep_due()


@shared_task(name="relay.remove_unused_registrations", ignore_result=True)
def remove_unused_registrations() -> int:
    """Beat task (CELERY_BEAT_SCHEDULE): registrations no publish ever reached."""
    from relay.services import registrations

    return registrations.remove_unused_registrations()


@shared_task(name="relay.prune_records", ignore_result=True)
def prune_records() -> int:
    """Beat task: records older than RELAY_RETENTION_DAYS."""
    from relay.services import retention

    return sum(retention.prune().values())


@shared_task(name="relay.run_daily_reports", ignore_result=True)
def run_daily_reports() -> int:
    """Beat task: the Spark reports of yesterday and today, in a process of their own."""
    from relay.services import reports

    return reports.run_reports()
