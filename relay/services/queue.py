"""The durable hand-off between the gateway (which answers publishes) and the send workers."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

from celery import current_app
from django.utils import timezone

from relay import amqp_publisher, broker, conf

log = logging.getLogger(__name__)

# The send tasks (relay/tasks.py), sent by name: the services never import the entry points.
SEND_PUSH = "relay.send_push"
SEND_PUSHES = "relay.send_pushes"


class QueueUnavailable(Exception):
    """The broker did not take the job: the publish must be answered with a `wait` error."""


@dataclass(frozen=True, slots=True)
class SendJob:
    """One push to send. It carries no token, JID or body: the worker reads the registration."""

    push_id: str
    registration_id: int
    publishing_domain: str
    important: bool
    received: str
    message_count: int | None = None
    pending_subscription_count: int | None = None
    queued: str = ""
    attempt: int = 1
    # Burst coalescing (relay/services/throttling/): a delayed send that carries the
    # publishes folded into it; `folded` counts them once the worker has claimed them.
    coalesced: bool = False
    folded: int = 0
    # When a dead letter was replayed (ISO time): the age limit counts from then.
    replayed: str = ""
    # The registration's app (0: not known): a worker counts the messages waiting for its
    # threads per app before it reads a registration (relay/services/provider_limits.py).
    app: int = 0

    def to_message(self) -> dict[str, Any]:
        # Flat fields: cheaper than dataclasses.asdict, which deep-copies (a gateway hot spot).
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> SendJob:
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in message.items() if key in names})


_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(SendJob))


def apps_of(task: str, args: Any) -> set[int | None]:
    """The apps whose sends a task message carries (None for a job that does not say);
    empty for a task that sends nothing."""
    try:
        if task == SEND_PUSH:
            return {args[0].get("app") or None}
        if task == SEND_PUSHES:
            return {job.get("app") or None for job in args[0]}
    except (AttributeError, IndexError, KeyError, TypeError):
        return {None}
    return set()


# Celery writes a repr of the arguments into every message's headers for its logs and
# monitors: formatting it (celery.utils.saferepr) is a cost per publish for nothing. The jobs
# carry nothing a log needs; the worker logs push ids itself.
_NO_REPRS: dict[str, Any] = {"argsrepr": "", "kwargsrepr": ""}


@functools.cache
def _direct_publisher(broker_url: str) -> amqp_publisher.ConfirmedPublisher | None:
    """On RabbitMQ, the gateway writes its messages itself (relay/amqp_publisher.py: cheaper
    than `send_task`, and confirmed within CELERY_CONFIRM_TIMEOUT); other brokers (the
    embedded one) go through Celery."""
    app_conf = current_app.conf
    if not broker_url.startswith(("amqp://", "pyamqp://")) or app_conf.task_routes:
        return None
    if app_conf.broker_use_ssl:  # TLS options outside the URL: kombu's client knows them
        return None
    relay = conf.current()
    return amqp_publisher.ConfirmedPublisher(
        broker_url,
        queue=broker.send_queue(relay),
        declare=[broker.dead_letter_queue(relay)],
        confirm_timeout=relay.celery_confirm_timeout,
    )


_AMQP = ("amqp://", "amqps://", "pyamqp://")
_delayed_ready: set[str] = set()


def ensure_delayed_delivery() -> None:
    """On RabbitMQ, a countdown travels through Celery's native delayed delivery exchanges,
    which workers declare when they start; declared here too (once per process), so a delayed
    send published before any worker ran is not refused."""
    url = str(current_app.conf.broker_url)
    if url in _delayed_ready or not url.startswith(_AMQP):
        return
    from kombu.transport.native_delayed_delivery import (
        bind_queue_to_native_delayed_delivery_exchange,
        declare_native_delayed_delivery_exchanges_and_queues,
    )

    with current_app.connection_for_write() as connection:
        declare_native_delayed_delivery_exchanges_and_queues(
            connection, current_app.conf.broker_native_delayed_delivery_queue_type
        )
        for declared in current_app.amqp.queues.values():
            declared.bind(connection.default_channel).declare()
            bind_queue_to_native_delayed_delivery_exchange(connection, declared)
    _delayed_ready.add(url)


def _publish(task: str, args: list[Any], countdown: float | None = None) -> None:
    publisher = _direct_publisher(str(current_app.conf.broker_url))
    if publisher is not None and not countdown:
        publisher.publish(task, args)
        return
    if countdown and str(current_app.conf.broker_url).startswith(_AMQP):
        ensure_delayed_delivery()
        # Native delayed delivery counts whole seconds and refuses a countdown under one.
        countdown = float(math.ceil(countdown))
    current_app.send_task(task, args=args, countdown=countdown, **_NO_REPRS)


def publish_task(task: str, args: list[Any], *, countdown: float | None = None) -> None:
    """Publish one task call as the relay does (confirmed on RabbitMQ); raises
    QueueUnavailable. For moving messages between brokers (relay/services/redis_drain.py)."""
    try:
        _publish(task, args, countdown)
    except Exception as error:  # kombu, amqp and socket errors all mean "not queued"
        log.warning("queue.publish_failed", extra={"error_type": type(error).__name__})
        raise QueueUnavailable from error


def enqueue_send(job: SendJob, *, countdown: float | None = None) -> SendJob:
    """Publish the job to the broker; returns only once the broker has it."""
    job = dataclasses.replace(job, queued=job.queued or timezone.now().isoformat())
    try:
        _publish(SEND_PUSH, [job.to_message()], countdown)
    except Exception as error:  # kombu, amqp and socket errors all mean "not queued"
        log.warning("queue.publish_failed", extra={"error_type": type(error).__name__})
        raise QueueUnavailable from error
    return job


def enqueue_sends(jobs: list[SendJob]) -> list[SendJob]:
    """Publish jobs that go out now as ONE broker message (relay.send_pushes); returns only
    once the broker has it. A single job travels as relay.send_push."""
    if not jobs:
        return []
    if len(jobs) == 1:
        return [enqueue_send(jobs[0])]
    queued = timezone.now().isoformat()
    jobs = [dataclasses.replace(job, queued=job.queued or queued) for job in jobs]
    try:
        _publish(SEND_PUSHES, [[job.to_message() for job in jobs]])
    except Exception as error:  # kombu, amqp and socket errors all mean "not queued"
        log.warning(
            "queue.publish_failed", extra={"error_type": type(error).__name__, "jobs": len(jobs)}
        )
        raise QueueUnavailable from error
    return jobs
