"""Celery entry points: parse the message, call the delivery service."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from relay.services import delivery
from relay.services.queue import SendJob


@shared_task(name="relay.send_push", acks_late=True, reject_on_worker_lost=True)
def send_push(message: dict[str, Any]) -> str:
    return delivery.deliver(SendJob.from_message(message)).value
