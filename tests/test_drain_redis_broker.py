"""The upgrade from the Redis broker (docs/broker.md): `manage.py drain_redis_broker`.

The old broker's Redis is filled the way earlier releases filled it: Celery's `send_task` on
kombu's Redis transport (the queue `celery`, a send due now and a delayed one), plus what a
stopped worker left held (`unacked`) and on its way (`relay.lease.<worker>.transit`). Then:

- `--move` publishes every one of them to RabbitMQ, confirmed, with its push id (the delayed
  one through the delayed delivery queues, its ETA kept), and leaves Redis empty;
- without it, the command waits until the old workers (here a kombu consumer) emptied the
  queue, and gives up with an error after `--timeout` while something is left.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from django.core.management import CommandError, call_command
from kombu import Connection

from pushsite.celery import app as celery_app
from relay.services import queue, redis_drain
from tests.support.broker import purge, queued_jobs_with_eta
from tests.support.services import PrivateRedis

pytestmark = pytest.mark.skipif(
    not str(celery_app.conf.broker_url).startswith("amqp://"),
    reason="the switch is to RabbitMQ (the PostgreSQL suite's broker)",
)


@pytest.fixture
def old_broker(monkeypatch) -> Iterator[tuple[str, redis.Redis]]:
    # Celery takes CELERY_BROKER_URL (the session's RabbitMQ) over an app's own broker.
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    with PrivateRedis() as server:
        yield server.url(0), redis.Redis.from_url(server.url(0))


def old_release_sends(url: str, count: int, *, countdown: float | None = None) -> list[str]:
    """Queue send jobs as earlier releases did; returns their push ids."""
    old = Celery("old", broker=url, set_as_current=False)
    push_ids = [str(uuid.uuid4()) for _ in range(count)]
    for push_id in push_ids:
        job = {"push_id": push_id, "registration_id": 1, "attempt": 1}
        old.send_task(queue.SEND_PUSH, args=[job], countdown=countdown)
    old.close()
    return push_ids


def test_move_publishes_everything_left_to_rabbitmq(old_broker):
    url, client = old_broker
    purge()
    now = old_release_sends(url, 3)
    [later] = old_release_sends(url, 1, countdown=600)
    # A stopped worker's leftovers: one message it held, one on its way to it.
    [held, moving] = [client.rpop("celery"), client.rpop("celery")]
    client.hset("unacked", "tag-1", json.dumps([json.loads(held), "", "celery"]))
    client.sadd("relay.lease.owners", "host/1/abc")
    client.lpush("relay.lease.host/1/abc.transit", moving)
    assert redis_drain.left(client) == redis_drain.Left(2, 1, 1)

    call_command("drain_redis_broker", "--from", url, "--move")

    assert redis_drain.left(client).total == 0
    found = {queued.job["push_id"]: queued for queued in queued_jobs_with_eta()}
    assert set(found) == {*now, later}
    assert found[later].eta is not None and all(found[p].eta is None for p in now)


def test_wait_returns_once_the_old_workers_emptied_the_queue(old_broker):
    url, client = old_broker
    old_release_sends(url, 2)
    with pytest.raises(CommandError, match="2 message"):
        call_command("drain_redis_broker", "--from", url, "--timeout", "0.3", "--interval", "0.1")

    def old_worker() -> None:  # takes and acknowledges, as a worker of the old release would
        with Connection(url) as connection:
            simple = connection.SimpleQueue("celery")
            for _ in range(2):
                simple.get(timeout=30).ack()
            simple.close()

    thread = threading.Thread(target=old_worker)
    thread.start()
    call_command("drain_redis_broker", "--from", url, "--timeout", "60", "--interval", "0.1")
    thread.join()
    assert redis_drain.left(client).total == 0


def test_a_url_that_is_not_redis_is_refused():
    with pytest.raises(CommandError, match="not a Redis URL"):
        call_command("drain_redis_broker", "--from", "amqp://guest:guest@127.0.0.1:5672//")
