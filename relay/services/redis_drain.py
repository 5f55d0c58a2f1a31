"""Emptying the Redis broker of earlier releases, for the switch to RabbitMQ (docs/broker.md).

The old broker kept the send tasks in Redis, in kombu's Redis layout with the relay's leases:
the queue (a list, `celery`), the messages workers held unacknowledged (the `unacked` hash,
`[message, exchange, routing key]`) and the messages on their way to a worker (the lists
`relay.lease.<worker>.transit`). Two ways out, both run with the gateways stopped:

- `wait`: the old workers empty it; this only counts what is left until nothing is;
- `move`: with the old workers stopped too, every message left (delayed retries included) is
  published to the current broker, confirmed, with its push ids, then removed from Redis. A
  message is first moved to a list of its own (`relay.drain.moving`), so one interrupted
  between the publish and the removal is published again by the next run, not lost
  (at-least-once: a push may go out twice, with its push id).
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis

from relay.services import queue

log = logging.getLogger(__name__)

QUEUE = "celery"
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"
OWNERS = "relay.lease.owners"
MOVING = "relay.drain.moving"


@dataclass(frozen=True, slots=True)
class Left:
    """What the old broker still holds."""

    waiting: int
    unacknowledged: int
    in_transit: int

    @property
    def total(self) -> int:
        return self.waiting + self.unacknowledged + self.in_transit


def _transit_keys(client: redis.Redis) -> list[str]:
    owners = [_text(owner) for owner in client.smembers(OWNERS)]
    return [f"relay.lease.{owner}.transit" for owner in owners]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def left(client: redis.Redis) -> Left:
    return Left(
        waiting=int(client.llen(QUEUE)) + int(client.llen(MOVING)),
        unacknowledged=int(client.hlen(UNACKED)),
        in_transit=sum(int(client.llen(key)) for key in _transit_keys(client)),
    )


def connect(url: str) -> redis.Redis:
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"not a Redis URL: {url.split('@')[-1]}")
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)


def task_call(payload: bytes | str) -> tuple[str, list[Any], float | None]:
    """(task name, positional arguments, seconds until its ETA) of a kombu Redis message."""
    message = json.loads(payload)
    body = message["body"]
    if message.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = json.loads(body)
    headers = message.get("headers", {})
    countdown = None
    if headers.get("eta"):
        eta = datetime.fromisoformat(headers["eta"])
        if eta.tzinfo is None:
            eta = eta.replace(tzinfo=UTC)
        countdown = max(0.0, (eta - datetime.now(UTC)).total_seconds()) or None
    return str(headers["task"]), list(args), countdown


def _publish(payload: bytes | str) -> None:
    task, args, countdown = task_call(payload)
    queue.publish_task(task, args, countdown=countdown)


def move(client: redis.Redis) -> int:
    """Publish every message left in the old broker to the current one; returns how many.
    Raises (and leaves the rest in Redis) when the current broker does not take one."""
    moved = 0
    # First what an interrupted run had taken but maybe not published.
    while (payload := client.lindex(MOVING, -1)) is not None:
        _publish(payload)
        client.rpop(MOVING)
        moved += 1
    for source in [QUEUE, *_transit_keys(client)]:
        while (taken := client.lmove(source, MOVING, "RIGHT", "LEFT")) is not None:
            _publish(taken)
            client.rpop(MOVING)
            moved += 1
    for tag, entry in client.hgetall(UNACKED).items():
        payload = json.dumps(json.loads(entry)[0])
        client.lpush(MOVING, payload)
        client.hdel(UNACKED, tag)
        client.zrem(UNACKED_INDEX, tag)
        _publish(payload)
        client.rpop(MOVING)
        moved += 1
    log.info("drain.moved", extra={"messages": moved})
    return moved
