"""Celery entry points: parse the message, call the delivery service.

A send is acknowledged only after `deliver` returned (acks_late): a worker killed mid-send
leaves the message unacknowledged, and the broker hands it to another worker (Redis: after
CELERY_VISIBILITY_TIMEOUT). The redelivered job keeps its push id, so it is told apart from a
new push and its Delivery row is updated, not doubled. The same holds for a batch message
(relay.send_pushes): it comes back whole, and every push in it keeps its id.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.signals import worker_process_shutdown, worker_shutdown

from relay.providers import registry
from relay.services import delivery
from relay.services.queue import SendJob


@shared_task(name="relay.send_push", acks_late=True, reject_on_worker_lost=True)
def send_push(message: dict[str, Any]) -> str:
    return delivery.deliver(SendJob.from_message(message)).value


@shared_task(name="relay.send_pushes", acks_late=True, reject_on_worker_lost=True)
def send_pushes(messages: list[dict[str, Any]]) -> int:
    """A batch the gateway queued as one message: acknowledged once every job in it is done
    (sent, retried individually, or dead-lettered), so a killed worker redelivers all of it."""
    outcomes = delivery.deliver_many([SendJob.from_message(message) for message in messages])
    return len(outcomes)


def _close_providers(**_: object) -> None:
    """Close provider connections when a worker stops cleanly (HTTP/2 goodbye to APNs)."""
    registry.close_all()


# prefork children get the first; the threads and solo pools only the second.
worker_process_shutdown.connect(_close_providers, weak=False)
worker_shutdown.connect(_close_providers, weak=False)


@shared_task(name="relay.remove_stale_uwpx_devices", ignore_result=True)
def remove_stale_uwpx_devices() -> int:
    """Beat task (CELERY_BEAT_SCHEDULE): Windows devices whose client went silent."""
    from relay.services import uwpx

    return uwpx.remove_stale_devices()


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
