"""Reading what the gateway queued, straight from the real broker (RabbitMQ or the embedded one).

On RabbitMQ a delayed send (a countdown) waits in Celery's native delayed delivery queues
(`celery_delayed_27` down to `_0`) before it reaches the send queue; those are read too, from
the longest delay down, the way messages move, so none is passed over.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kombu import Queue

from pushsite.celery import app as celery_app
from relay.services.queue import ensure_delayed_delivery

QUEUE = str(celery_app.conf.task_default_queue)
RABBITMQ = str(celery_app.conf.broker_url).startswith(("amqp://", "pyamqp://"))
DELAYED = [f"celery_delayed_{level}" for level in range(27, -1, -1)] if RABBITMQ else []


def through(port: int) -> str:
    """The broker URL with its host and port replaced by 127.0.0.1:port (a proxy's)."""
    parts = urlsplit(str(celery_app.conf.broker_url))
    credentials = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{credentials}127.0.0.1:{port}"))


@contextlib.contextmanager
def away() -> Iterator[None]:
    """The broker unreachable for the relay's publishes: its URL on a port nothing listens
    on. Celery's `broker_url` prefers the environment's CELERY_BROKER_URL over its settings,
    so that is where it changes."""
    # The first node's URL alone: a list of nodes would fail over to the others.
    dead = through(_closed_port()).split(";")[0]
    saved = os.environ.get("CELERY_BROKER_URL")
    os.environ["CELERY_BROKER_URL"] = dead
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CELERY_BROKER_URL"]
        else:
            os.environ["CELERY_BROKER_URL"] = saved


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed again when the block ends


def _send_queue() -> Any:
    return celery_app.amqp.queues[QUEUE]


def purge() -> None:
    ensure_delayed_delivery()
    with celery_app.connection_for_write() as conn:
        channel = conn.default_channel
        _send_queue().bind(channel).declare()
        for name in [*DELAYED, QUEUE]:
            channel.queue_purge(name)


def depth() -> int:
    """Messages ready in the send queue (not those a worker holds unacknowledged)."""
    with celery_app.connection_for_read() as conn:
        declared = _send_queue().bind(conn.default_channel)
        return int(declared.queue_declare(passive=True).message_count)


@dataclass(frozen=True)
class QueuedJob:
    job: dict[str, Any]
    eta: datetime | None
    task: str = ""


def queued_jobs_with_eta(limit: int = 1000) -> list[QueuedJob]:
    """Take the queued task messages (their first argument: a send job, a batch of them) with
    their ETA (a delayed send's countdown) and task name."""
    found: list[QueuedJob] = []
    with celery_app.connection_for_read() as conn:
        # Due now first, then the delayed ones, then the queue again for one that became due
        # while the others were read.
        for name in [QUEUE, *DELAYED, *([QUEUE] if DELAYED else [])]:
            declared = _send_queue() if name == QUEUE else Queue(name, no_declare=True)
            queue = conn.SimpleQueue(declared)
            try:
                while len(found) < limit:
                    try:
                        message = queue.get(block=False)
                    except queue.Empty:
                        break
                    args, _kwargs, _embed = message.decode()
                    eta = message.headers.get("eta")
                    found.append(
                        QueuedJob(
                            args[0],
                            datetime.fromisoformat(eta) if eta else None,
                            str(message.headers.get("task", "")),
                        )
                    )
                    message.ack()
            finally:
                queue.close()
    return found


def queued_jobs(limit: int = 1000) -> list[dict[str, Any]]:
    """Take the send jobs waiting in the queue (they are consumed)."""
    return [queued.job for queued in queued_jobs_with_eta(limit)]
