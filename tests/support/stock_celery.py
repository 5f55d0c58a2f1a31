"""A stock Celery app that knows nothing of the relay: one queue, declared as the environment
says, and one task of the name given, which appends each message it runs to a file.

Why a process of its own: what the gateway's publisher writes must run on a worker that
shares nothing with the relay (no Django, no relay signals, no state of the test process).
`celery -A tests.support.stock_celery worker` with STOCK_BROKER_URL, STOCK_QUEUE,
STOCK_QUEUE_ARGUMENTS (JSON), STOCK_EXCHANGE_TYPE, STOCK_TASK and STOCK_RECEIVED (a file).
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

NAME = os.environ["STOCK_QUEUE"]
RECEIVED = os.environ["STOCK_RECEIVED"]

app = Celery("stock", broker=os.environ["STOCK_BROKER_URL"])
app.conf.update(
    task_queues=[
        Queue(
            NAME,
            Exchange(NAME, type=os.environ.get("STOCK_EXCHANGE_TYPE", "topic"), durable=True),
            routing_key=NAME,
            durable=True,
            queue_arguments=json.loads(os.environ.get("STOCK_QUEUE_ARGUMENTS", "{}")),
        )
    ],
    task_default_queue=NAME,
    broker_transport_options={"confirm_publish": True},
    broker_connection_retry_on_startup=True,
)


@app.task(name=os.environ["STOCK_TASK"])
def run(message: Any) -> None:
    with open(RECEIVED, "a", encoding="utf-8") as received:
        received.write(json.dumps(message) + "\n")
