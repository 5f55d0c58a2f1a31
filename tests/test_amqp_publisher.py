"""The gateway's publisher (relay/amqp_publisher.py) against a real RabbitMQ.

It bypasses Celery's producer, so what it writes must stay what `send_task` writes: compared
field by field (properties, headers, body, exchange and routing key) with a real `send_task`
message in the same queue, and run by a stock Celery worker (an app that knows nothing of the
relay but the queue). It returns only once the broker confirmed, or raises within its
confirm timeout: the gateway then answers `wait` (tests/test_gateway_outages.py end to end).
Runs on the PostgreSQL/RabbitMQ suite only: the embedded broker keeps Celery's producer.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import amqp
import pytest

from pushsite.celery import app as celery_app
from relay import broker, conf
from relay.amqp_publisher import ConfirmedPublisher, PublishFailed, nodes_of
from relay.environment import Environment
from relay.services import queue
from tests.support.broker import purge
from tests.support.processes import ServiceProcess, wait_until
from tests.support.rabbitmq import PrivateRabbit

pytestmark = pytest.mark.skipif(
    not str(celery_app.conf.broker_url).startswith("amqp://"),
    reason="the direct publisher exists for RabbitMQ only (the defaults suite's is SQLite)",
)

# Per message, not per code path: ids, and this process's name.
VARYING_HEADERS = {"id", "root_id", "origin"}
VARYING_PROPERTIES = {"correlation_id", "reply_to"}  # reply_to: the relay keeps no results


def publisher(url: str | None = None, *, timeout: float = 2.0, name: str = "") -> Any:
    env = Environment(celery_queue=name) if name else conf.current()
    return ConfirmedPublisher(
        url or str(celery_app.conf.broker_url),
        queue=broker.send_queue(env),
        declare=[broker.dead_letter_queue(env)],
        confirm_timeout=timeout,
    )


def raw_messages(name: str) -> list[amqp.Message]:
    """Take every message waiting in the queue, as py-amqp reads it off the wire."""
    [node] = nodes_of(str(celery_app.conf.broker_url))
    connection = amqp.Connection(node.host, userid=node.userid, password=node.password)
    connection.connect()
    try:
        channel = connection.channel()
        found = []
        while (message := channel.basic_get(name, no_ack=True)) is not None:
            found.append(message)
        return found
    finally:
        connection.close()


def comparable(message: amqp.Message) -> dict[str, Any]:
    properties = dict(message.properties)
    headers = {
        key: value
        for key, value in properties.pop("application_headers", {}).items()
        if key not in VARYING_HEADERS
    }
    for key in VARYING_PROPERTIES:
        properties.pop(key, None)
    return {
        "properties": properties,
        "headers": headers,
        "body": json.loads(message.body),
        "exchange": message.delivery_info["exchange"],
        "routing_key": message.delivery_info["routing_key"],
    }


def test_the_publisher_writes_what_send_task_writes():
    purge()
    job = {"push_id": str(uuid.uuid4()), "registration_id": 7, "important": True}
    celery_app.send_task(queue.SEND_PUSH, args=[job], argsrepr="", kwargsrepr="")
    direct = publisher()
    direct.publish(queue.SEND_PUSH, [job])
    direct.close()
    celerys, ours = raw_messages(celery_app.conf.task_default_queue)
    assert comparable(ours) == comparable(celerys)
    # What differs is per message: fresh ids, each the same in its three places.
    headers = ours.properties["application_headers"]
    assert headers["id"] == headers["root_id"] == ours.properties["correlation_id"]
    assert ours.properties["delivery_mode"] == 2  # persistent


def test_a_batch_message_matches_too():
    purge()
    jobs = [{"push_id": str(uuid.uuid4()), "registration_id": n} for n in range(3)]
    celery_app.send_task(queue.SEND_PUSHES, args=[jobs], argsrepr="", kwargsrepr="")
    direct = publisher()
    direct.publish(queue.SEND_PUSHES, [jobs])
    direct.close()
    celerys, ours = raw_messages(celery_app.conf.task_default_queue)
    assert comparable(ours) == comparable(celerys)


def test_the_gateway_publishes_through_it_on_rabbitmq():
    found = queue._direct_publisher(str(celery_app.conf.broker_url))
    assert isinstance(found, ConfirmedPublisher)
    assert found.confirm_timeout == conf.current().celery_confirm_timeout


@pytest.fixture
def stock_worker(tmp_path: Path) -> Iterator[tuple[str, Path, ServiceProcess]]:
    """A stock Celery worker in a process of its own (tests/support/stock_celery.py): an app
    that knows nothing of the relay but a queue declared as the relay's and a task of the
    relay's name."""
    name = f"relay.stock-{uuid.uuid4().hex[:8]}"
    declared = broker.send_queue(Environment(celery_queue=name))
    received = tmp_path / "received.jsonl"
    env = dict(os.environ)
    env.update(
        STOCK_BROKER_URL=str(celery_app.conf.broker_url),
        STOCK_QUEUE=name,
        STOCK_QUEUE_ARGUMENTS=json.dumps(declared.queue_arguments),
        STOCK_EXCHANGE_TYPE=declared.exchange.type,
        STOCK_TASK=queue.SEND_PUSH,
        STOCK_RECEIVED=str(received),
        PYTHONUNBUFFERED="1",
    )
    argv = [
        sys.executable, "-m", "celery", "-A", "tests.support.stock_celery", "worker",
        "--hostname", f"{name}@%h", "--pool", "solo", "--loglevel", "INFO",
        "--without-heartbeat", "--without-gossip", "--without-mingle",
    ]  # fmt: skip
    worker = ServiceProcess("stock-worker", argv, env)
    try:
        yield name, received, worker
    finally:
        worker.stop()


def lines_of(path: Path) -> list[Any]:
    """The complete lines the worker wrote so far (one it is writing is left for later)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def test_a_stock_celery_worker_runs_what_it_writes(stock_worker):
    name, received, worker = stock_worker
    direct = publisher(name=name)
    jobs = [{"push_id": str(uuid.uuid4()), "registration_id": n} for n in range(5)]
    for job in jobs:
        direct.publish(queue.SEND_PUSH, [job])
    direct.close()

    def all_run() -> bool:
        if not worker.alive():
            raise RuntimeError(f"the stock worker died:\n{worker.log_tail()}")
        return len(lines_of(received)) >= len(jobs)

    wait_until(all_run, what=lambda: f"{len(lines_of(received))} of 5 run\n{worker.log_tail()}")
    assert lines_of(received) == jobs


# --- the broker does not confirm: PublishFailed within the confirm timeout


def test_a_closed_port_fails_within_the_timeout():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(PublishFailed):
        publisher(f"amqp://guest:guest@127.0.0.1:{port}//", timeout=0.5).publish("t", [{}])
    assert time.monotonic() - started < 1.5


def test_a_broker_that_never_answers_fails_within_the_timeout():
    """A host that takes the TCP connection and then says nothing (a hung node, a half-open
    network path): bounded by the confirm timeout too."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(silent.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        url = f"amqp://guest:guest@127.0.0.1:{silent.getsockname()[1]}//"
        started = time.monotonic()
        with pytest.raises(PublishFailed):
            publisher(url, timeout=1.0).publish("t", [{}])
        took = time.monotonic() - started
        assert 0.9 < took < 2.5, took
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        silent.close()


def test_a_node_that_goes_away_fails_fast_and_is_used_again_once_back():
    with PrivateRabbit() as node:
        direct = publisher(node.url(), timeout=1.0, name="relay.outage")
        direct.publish("t", [{"n": 1}])
        node.stop()
        started = time.monotonic()
        with pytest.raises(PublishFailed):
            direct.publish("t", [{"n": 2}])
        assert time.monotonic() - started < 2.0
        node.start()
        direct.publish("t", [{"n": 3}])  # a fresh connection, no restart of the publisher
        direct.close()
        connection = amqp.Connection(f"127.0.0.1:{node.port}")
        connection.connect()
        try:
            depth = connection.channel().queue_declare("relay.outage", passive=True)
        finally:
            connection.close()
        assert depth.message_count == 2  # the first (kept through the restart) and the third


def test_the_nodes_of_a_failover_url():
    nodes = nodes_of("amqp://u:p@a:5672//;amqp://u:p@b:5673/vh")
    assert [(n.host, n.userid, n.password, n.virtual_host) for n in nodes] == [
        ("a:5672", "u", "p", "/"),
        ("b:5673", "u", "p", "vh"),
    ]
