"""relay/redis_broker.py against a real Redis of its own: the adapter over kombu's internals.

- a taken message is always somewhere in Redis: in the queue, in the taker's transit list, or
  in the unacknowledged hash (indexed under the taker's lease);
- an expired lease's messages (in transit, unacknowledged) go back to their queue, once;
- a message whose pop reply was lost on a live channel goes back too;
- closing a channel after the broker went away, as Celery does on a connection loss, no
  longer kills the worker (kombu's own transport raises AttributeError there).

The worker processes are in test_faults.py.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue

from relay import redis_broker
from tests.support.services import PrivateRedis
from tests.support.waiting import wait_until

QUEUE = "faults"
STOCK = "kombu.transport.redis:Transport"
LEASED = "relay.redis_broker:Transport"


@pytest.fixture
def server() -> Iterator[PrivateRedis]:
    with PrivateRedis(durable=True) as instance:
        yield instance


def connect(server: PrivateRedis, transport: str = LEASED, **options: Any) -> Connection:
    return Connection(
        server.url(0),
        transport=transport,
        transport_options={"lease_seconds": 1.0, "socket_timeout": 2, **options},
    )


def publish(connection: Connection, *bodies: str) -> None:
    queue = Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE)
    with connection.Producer() as producer:
        for body in bodies:
            producer.publish(body, exchange=queue.exchange, routing_key=QUEUE, declare=[queue])


def take(connection: Connection, count: int = 1) -> Any:
    """The next message (or `count` of them), taken and not acknowledged."""
    queue = connection.SimpleQueue(QUEUE)
    messages = [queue.get(timeout=5) for _ in range(count)]
    return messages[0] if count == 1 else messages


def keys(server: PrivateRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url(0))


def test_a_taken_message_is_indexed_under_the_lease_until_acked(server):
    with connect(server) as connection:
        publish(connection, "one")
        message = take(connection)
        channel = message.channel
        client = keys(server)
        owner = channel.owner
        assert owner and client.exists(redis_broker.lease_key(owner))
        assert client.llen(redis_broker.transit_key(owner)) == 0  # moved on, in one MULTI
        assert client.hkeys(redis_broker.held_key(owner)) == [message.delivery_tag.encode()]
        assert client.hexists("unacked", message.delivery_tag)
        message.ack()
        assert client.hlen(redis_broker.held_key(owner)) == 0
        assert client.hlen("unacked") == 0 and client.llen(QUEUE) == 0


def test_an_expired_lease_gives_back_what_it_held(server):
    client = keys(server)
    with connect(server) as dead:
        publish(dead, "held", "in transit")
        held = take(dead)  # taken, never acknowledged
        owner = held.channel.owner
        # The second one popped at the very moment the worker died: moved, never recorded.
        client.lmove(QUEUE, redis_broker.transit_key(owner), "RIGHT", "LEFT")
        client.delete(redis_broker.lease_key(owner))  # the lease expired
        with connect(server) as alive:
            channel = alive.default_channel
            channel._take_lease()
            assert redis_broker.sweep(channel) == 1
            assert redis_broker.sweep(channel) == 0  # once
            bodies = sorted(message.payload for message in take(alive, 2))
    assert bodies == ["held", "in transit"]
    assert client.sismember(redis_broker.OWNERS_KEY, owner) == 0
    assert client.llen(redis_broker.transit_key(owner)) == 0


def test_a_live_lease_keeps_what_it_holds(server):
    with connect(server) as worker, connect(server) as other:
        publish(worker, "mine")
        take(worker)
        channel = other.default_channel
        channel._take_lease()
        assert redis_broker.sweep(channel) == 0
        assert keys(server).llen(QUEUE) == 0


def test_a_pop_whose_reply_was_lost_comes_back_on_a_live_channel(server):
    with connect(server) as connection:
        channel = connection.default_channel
        channel._take_lease()
        publish(connection, "stranded")
        # As if a BLMOVE's reply had been lost with its connection.
        keys(server).lmove(QUEUE, redis_broker.transit_key(channel.owner), "RIGHT", "LEFT")
        assert channel.recover_stranded() == 1
        assert take(connection).payload == "stranded"


@pytest.mark.parametrize("transport", [STOCK, LEASED])
def test_closing_after_the_broker_went_away_does_not_crash(server, transport):
    """What Celery's consumer does on a connection loss: collect, then close. A worker has
    several channels with a pop outstanding (tasks, control); the first to fail stops
    `collect` from closing the others, and kombu's transport then raises AttributeError
    ('hostname') while the task channel gives back a message it holds: the worker died."""
    connection = connect(server, transport)
    publish(connection, "unacknowledged")
    take(connection)
    control = connection.channel()
    Consumer(control, [Queue("control", Exchange("control"), routing_key="control")]).consume()
    with contextlib.suppress(socket.timeout):  # both pops are outstanding, as in a worker
        connection.drain_events(timeout=0.1)
    server.stop()
    connection.collect(socket_timeout=0.5)
    if transport == STOCK:
        with pytest.raises(AttributeError, match="hostname"):
            connection.close()
        return
    connection.close()
    server.start()
    # It could not be given back while the broker was away; once the lease has expired, any
    # consumer gives it back.
    client = keys(server)
    owners = [owner.decode() for owner in client.smembers(redis_broker.OWNERS_KEY)]
    assert len(owners) == 2  # the task channel's and the control channel's

    def leases_expired() -> bool:
        return not any(client.exists(redis_broker.lease_key(owner)) for owner in owners)

    wait_until(leases_expired, what="the closed connection's leases expire")
    with connect(server) as again:
        channel = again.default_channel
        channel._take_lease()
        assert redis_broker.sweep(channel) == 2  # the task channel's lease and the control's
        assert take(again).payload == "unacknowledged"
