"""Reading what the gateway queued, straight from the real broker (Redis or the embedded one)."""

from __future__ import annotations

from typing import Any

from pushsite.celery import app as celery_app

QUEUE = "celery"


def purge() -> None:
    with celery_app.connection_for_write() as conn:
        conn.default_channel.queue_declare(QUEUE, durable=True, auto_delete=False)
        conn.default_channel.queue_purge(QUEUE)


def queued_jobs(limit: int = 1000) -> list[dict[str, Any]]:
    """Take the send jobs waiting in the queue (they are consumed)."""
    jobs: list[dict[str, Any]] = []
    with celery_app.connection_for_read() as conn:
        queue = conn.SimpleQueue(QUEUE)
        try:
            for _ in range(limit):
                try:
                    message = queue.get(block=False)
                except queue.Empty:
                    break
                args, _kwargs, _embed = message.decode()
                jobs.append(args[0])
                message.ack()
        finally:
            queue.close()
    return jobs
