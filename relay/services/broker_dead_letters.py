"""Sends RabbitMQ gave up on, made the relay's own dead letters.

A send delivered CELERY_DELIVERY_LIMIT times without an acknowledgement (each delivery
killed its worker, say) is dead-lettered by the quorum queue to `<queue>.dead`
(relay/broker.py). Nothing runs those messages: every worker's sweeper
(relay/services/worker_sweeps.py) takes them one by one, records their jobs as dead letters
(replayable with the same push id, docs/faults.md) and only then acknowledges them. A message
it cannot record stays in the queue for the next round: never dropped.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import current_app

from relay import broker, conf
from relay.services import delivery, queue

log = logging.getLogger(__name__)

REASON = "broker delivery limit"


def is_rabbitmq() -> bool:
    return str(current_app.conf.broker_url).startswith(("amqp://", "amqps://", "pyamqp://"))


def declare() -> None:
    """Declare the dead-letter queue (RabbitMQ drops what it would dead-letter to nowhere);
    workers do at start, the gateway's publisher when it connects."""
    if not is_rabbitmq():
        return
    with current_app.connection_for_write() as connection:
        broker.dead_letter_queue(conf.current()).bind(connection.default_channel).declare()


def jobs_of(task: str, args: list[Any]) -> list[queue.SendJob]:
    """The send jobs a task message carries ([] for any other task)."""
    if task == queue.SEND_PUSH:
        return [queue.SendJob.from_message(args[0])]
    if task == queue.SEND_PUSHES:
        return [queue.SendJob.from_message(message) for message in args[0]]
    return []


def _task_call(message: Any) -> tuple[str, list[Any]]:
    """(task name, positional arguments) of a Celery task message; ("", []) for anything else."""
    try:
        args, _kwargs, _embed = message.decode()
        return str(message.headers.get("task", "")), list(args)
    except (TypeError, ValueError) as error:
        log.error("broker.dead_letter_undecodable", extra={"error_type": type(error).__name__})
        return "", []


def collect(limit: int = 500) -> int:
    """Record up to `limit` dead-lettered messages; returns how many jobs became dead letters."""
    if not is_rabbitmq():
        return 0
    buried = 0
    with current_app.connection_for_write() as connection:
        simple = connection.SimpleQueue(broker.dead_letter_queue(conf.current()))
        try:
            for _ in range(limit):
                try:
                    message = simple.get(block=False)
                except simple.Empty:
                    break
                task, args = _task_call(message)
                jobs = jobs_of(task, args)
                if jobs:
                    buried += delivery.bury(jobs, REASON)
                elif task == "relay.record_outcomes":
                    delivery.record(delivery.Bookkeeping.from_message(args[0]))
                else:  # not ours to judge: left for an operator (relay_queue_depth shows it)
                    log.error("broker.dead_letter_unknown", extra={"task": task})
                    message.requeue()
                    break
                message.ack()
                log.warning("broker.dead_lettered", extra={"task": task, "jobs": len(jobs)})
        finally:
            simple.close()
    return buried
