"""Reading what the gateway queued, straight from the real broker (Redis or the embedded one)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pushsite.celery import app as celery_app

QUEUE = "celery"


def purge() -> None:
    with celery_app.connection_for_write() as conn:
        conn.default_channel.queue_declare(QUEUE, durable=True, auto_delete=False)
        conn.default_channel.queue_purge(QUEUE)


@dataclass(frozen=True)
class QueuedJob:
    job: dict[str, Any]
    eta: datetime | None


def queued_jobs_with_eta(limit: int = 1000) -> list[QueuedJob]:
    """Take the queued send jobs with their ETA (a delayed send's countdown)."""
    found: list[QueuedJob] = []
    with celery_app.connection_for_read() as conn:
        queue = conn.SimpleQueue(QUEUE)
        try:
            for _ in range(limit):
                try:
                    message = queue.get(block=False)
                except queue.Empty:
                    break
                args, _kwargs, _embed = message.decode()
                eta = message.headers.get("eta")
                found.append(QueuedJob(args[0], datetime.fromisoformat(eta) if eta else None))
                message.ack()
        finally:
            queue.close()
    return found


def queued_jobs(limit: int = 1000) -> list[dict[str, Any]]:
    """Take the send jobs waiting in the queue (they are consumed)."""
    return [queued.job for queued in queued_jobs_with_eta(limit)]
