"""The private PostgreSQL, Redis and RabbitMQ servers that test sessions and fault tests start."""

from __future__ import annotations

import amqp
import redis

from tests.support.rabbitmq import PrivateRabbit, PrivateRabbitCluster, amqp_ready
from tests.support.services import PrivatePostgres, PrivateRedis
from tests.support.waiting import wait_until


def test_postgres_restart_keeps_data_and_replica_follows_primary() -> None:
    with PrivatePostgres() as primary:
        primary.psql("CREATE TABLE t (x int)")
        standby = primary.replica()
        try:
            primary.psql("INSERT INTO t VALUES (1), (2)")
            wait_until(
                lambda: standby.psql("SELECT count(*) FROM t") == "2",
                what="the replica catches up",
            )
            assert standby.psql("SELECT pg_is_in_recovery()") == "t"
        finally:
            standby.close()
        primary.restart()
        assert primary.psql("SELECT count(*) FROM t") == "2"


def test_redis_restart_on_the_same_port() -> None:
    with PrivateRedis() as server:
        client = redis.Redis.from_url(server.url())
        assert client.ping()
        server.restart()
        assert server.running()
        assert redis.Redis.from_url(server.url()).ping()


def _publish_and_count(port: int, queue: str, body: bytes | None = None) -> int:
    """Declare a durable quorum queue, optionally publish one confirmed message; its depth."""
    connection = amqp.Connection(f"127.0.0.1:{port}", confirm_publish=True)
    connection.connect()
    try:
        channel = connection.channel()
        channel.queue_declare(
            queue, durable=True, auto_delete=False, arguments={"x-queue-type": "quorum"}
        )
        if body is not None:
            channel.basic_publish(amqp.Message(body, delivery_mode=2), routing_key=queue)
        return int(channel.queue_declare(queue, passive=True).message_count)
    finally:
        connection.close()


def test_rabbitmq_node_keeps_a_confirmed_message_through_restart_and_kill() -> None:
    with PrivateRabbit() as node:
        assert _publish_and_count(node.port, "q", b"one") == 1
        node.restart()
        assert _publish_and_count(node.port, "q") == 1
        node.kill()
        assert not node.running() and not amqp_ready(node.port)
        node.start()
        assert _publish_and_count(node.port, "q", b"two") == 2


def test_rabbitmq_cluster_replaces_a_node_whose_disk_is_gone() -> None:
    with PrivateRabbitCluster() as cluster:
        first, _, lost = cluster.nodes
        assert _publish_and_count(first.port, "q", b"one") == 1
        assert lost.node in cluster.members()
        lost.kill()
        lost.wipe()
        assert not lost.mnesia.exists()
        assert _publish_and_count(first.port, "q", b"two") == 2  # two of three: a quorum
        cluster.replace_node(lost)
        status = first.ctl("quorum_status", "q", tool="rabbitmq-queues")
        members = [line for line in status.splitlines() if "leader" in line or "follower" in line]
        assert len(members) == 3 and lost.node in status, status  # a replica on it again
        assert _publish_and_count(lost.port, "q") == 2
