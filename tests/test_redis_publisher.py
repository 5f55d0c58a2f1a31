"""The gateway's direct write to the Redis broker (relay/redis_broker.py TaskPublisher).

It bypasses Celery's producer, so what it writes must stay what `send_task` writes: compared
field by field with a real `send_task` message in the same Redis, consumed through kombu, and
run by a real Celery worker (tests/test_e2e_relay.py and the fault tests send every push
through it too). Runs on the PostgreSQL/Redis suite only: the embedded broker keeps Celery's
own producer.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

from pushsite.celery import app as celery_app
from relay import redis_broker
from relay.services import queue
from tests.support.broker import QUEUE, purge, queued_jobs_with_eta

pytestmark = pytest.mark.skipif(
    not str(celery_app.conf.broker_url).startswith("redis://"),
    reason="the direct write exists for the Redis broker only (the defaults suite's is SQLite)",
)

# Per message, not per code path: ids, this process's name, and when it was written.
VARYING = {("headers", "id"), ("headers", "root_id"), ("headers", "origin"), ("headers", "eta")}
VARYING |= {("properties", "correlation_id"), ("properties", "delivery_tag")}
VARYING |= {("properties", "reply_to")}  # Celery's result queue: the relay keeps no results


def raw_messages() -> list[dict[str, Any]]:
    client = redis.Redis.from_url(str(celery_app.conf.broker_url))
    try:
        return [json.loads(item) for item in reversed(client.lrange(QUEUE, 0, -1))]
    finally:
        client.close()


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    """The message without what differs between any two sends; the body decoded."""
    out: dict[str, Any] = {}
    for key, value in message.items():
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if (key, k) not in VARYING}
        out[key] = value
    # Celery copies argsrepr/kwargsrepr into the properties too; a worker reads them from the
    # headers only.
    for name in ("argsrepr", "kwargsrepr"):
        out["properties"].pop(name, None)
    out["body"] = json.loads(base64.b64decode(message["body"]))
    return out


@pytest.fixture
def empty_queue():
    purge()
    yield
    purge()


def publisher() -> redis_broker.TaskPublisher:
    publisher = queue._direct_publisher(str(celery_app.conf.broker_url))
    assert publisher is not None, "the relay must write its own messages on Redis"
    return publisher


def test_the_direct_message_is_what_send_task_writes(empty_queue):
    job = {"push_id": "p-1", "registration_id": 7, "important": True, "received": "x"}
    celery_app.send_task(queue.SEND_PUSHES, args=[[job]], argsrepr="", kwargsrepr="")
    publisher().publish(queue.SEND_PUSHES, [[job]])
    theirs, ours = raw_messages()
    assert comparable(ours) == comparable(theirs)
    assert (
        ours["headers"]["id"] == ours["headers"]["root_id"] == ours["properties"]["correlation_id"]
    )


def test_a_countdown_becomes_celerys_eta(empty_queue):
    before = datetime.now(UTC)
    celery_app.send_task(queue.SEND_PUSH, args=[{"a": 1}], countdown=30, argsrepr="", kwargsrepr="")
    publisher().publish(queue.SEND_PUSH, [{"a": 1}], countdown=30)
    theirs, ours = raw_messages()
    assert comparable(ours) == comparable(theirs)
    [first, second] = queued_jobs_with_eta()  # read back through kombu, as a worker would
    for found in (first, second):
        assert found.job == {"a": 1}
        assert found.eta is not None
        assert (
            before + timedelta(seconds=29) < found.eta < datetime.now(UTC) + timedelta(seconds=31)
        )


def test_enqueue_sends_writes_one_message_for_the_batch(empty_queue):
    jobs = [
        queue.SendJob(f"p-{n}", n, "example.org", False, datetime.now(UTC).isoformat())
        for n in range(3)
    ]
    queued = queue.enqueue_sends(jobs)
    [message] = raw_messages()
    assert message["headers"]["task"] == queue.SEND_PUSHES
    [found] = queued_jobs_with_eta()
    assert [item["push_id"] for item in found.job] == ["p-0", "p-1", "p-2"]
    assert all(item["queued"] for item in found.job)
    assert [job.push_id for job in queued] == ["p-0", "p-1", "p-2"]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_broker_that_does_not_answer_fails_after_the_retry_policy():
    dead = redis_broker.TaskPublisher(
        f"redis://127.0.0.1:{closed_port()}/0",
        transport_options={"socket_connect_timeout": 1, "socket_timeout": 1},
        retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.2},
    )
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        dead.publish(queue.SEND_PUSH, [{"a": 1}])
    # Three attempts, paused 0 and 0.2 s: it tried again, and it did not hang.
    assert 0.2 <= time.monotonic() - started < 5


def test_the_queue_reports_an_unreachable_broker_as_unavailable(monkeypatch, empty_queue):
    dead = redis_broker.TaskPublisher(
        f"redis://127.0.0.1:{closed_port()}/0",
        transport_options={"socket_connect_timeout": 1},
        retry_policy={},
    )
    monkeypatch.setattr(queue, "_direct_publisher", lambda url: dead)
    job = queue.SendJob("p-9", 9, "example.org", False, datetime.now(UTC).isoformat())
    with pytest.raises(queue.QueueUnavailable):
        queue.enqueue_send(job)
    assert raw_messages() == []


@pytest.mark.parametrize(
    ("changes", "direct"),
    [
        ({}, True),
        ({"task_routes": {"relay.send_push": {"queue": "elsewhere"}}}, False),
        ({"broker_use_ssl": {"ssl_cert_reqs": "required"}}, False),
    ],
)
def test_routed_or_tls_configured_brokers_keep_celerys_producer(changes, direct):
    """The direct write knows the default queue and a plain URL only."""
    before = {name: celery_app.conf[name] for name in changes}
    celery_app.conf.update(changes)
    queue._direct_publisher.cache_clear()
    try:
        found = queue._direct_publisher(str(celery_app.conf.broker_url))
        assert (found is not None) is direct
    finally:
        celery_app.conf.update(before)
        queue._direct_publisher.cache_clear()
