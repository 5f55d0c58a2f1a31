"""The durable hand-off between the gateway (which answers publishes) and the send workers."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

from celery import current_app
from django.utils import timezone

from relay import redis_broker

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

    def to_message(self) -> dict[str, Any]:
        # Flat fields: cheaper than dataclasses.asdict, which deep-copies (a gateway hot spot).
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> SendJob:
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in message.items() if key in names})


_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(SendJob))
# Celery writes a repr of the arguments into every message's headers for its logs and
# monitors: formatting it (celery.utils.saferepr) is a cost per publish for nothing. The jobs
# carry nothing a log needs; the worker logs push ids itself.
_NO_REPRS: dict[str, Any] = {"argsrepr": "", "kwargsrepr": ""}


@functools.cache
def _direct_publisher(broker_url: str) -> redis_broker.TaskPublisher | None:
    """On Redis, the gateway writes its messages itself (relay/redis_broker.py says why:
    `send_task` would be a large part of its CPU per publish); other brokers (the embedded one)
    go through Celery."""
    conf = current_app.conf
    if not broker_url.startswith(("redis://", "rediss://")) or conf.task_routes:
        return None
    if conf.broker_use_ssl:  # TLS options outside the URL: kombu's client knows them
        return None
    return redis_broker.TaskPublisher(
        broker_url,
        transport_options=dict(conf.broker_transport_options or {}),
        retry_policy=dict(conf.task_publish_retry_policy or {}) if conf.task_publish_retry else {},
        queue=conf.task_default_queue,
    )


def _publish(task: str, args: list[Any], countdown: float | None = None) -> None:
    publisher = _direct_publisher(str(current_app.conf.broker_url))
    if publisher is not None:
        publisher.publish(task, args, countdown=countdown)
    else:
        current_app.send_task(task, args=args, countdown=countdown, **_NO_REPRS)


def enqueue_send(job: SendJob, *, countdown: float | None = None) -> SendJob:
    """Publish the job to the broker; returns only once the broker has it."""
    job = dataclasses.replace(job, queued=job.queued or timezone.now().isoformat())
    try:
        _publish(SEND_PUSH, [job.to_message()], countdown)
    except Exception as error:  # kombu, redis, amqp and socket errors all mean "not queued"
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
    except Exception as error:  # kombu, redis, amqp and socket errors all mean "not queued"
        log.warning(
            "queue.publish_failed", extra={"error_type": type(error).__name__, "jobs": len(jobs)}
        )
        raise QueueUnavailable from error
    return jobs
