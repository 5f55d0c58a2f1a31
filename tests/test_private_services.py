"""The private PostgreSQL and Redis servers that test sessions and fault tests start."""

from __future__ import annotations

import redis

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
