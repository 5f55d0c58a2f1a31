"""Faults mid-stream, a server gone: PostgreSQL, RabbitMQ or Redis restarted, the whole broker
down for 20 s. No push answered `result` is lost (the lab: tests/support/fault_lab.py)."""

from __future__ import annotations

import time

import pytest

from tests.support.fault_lab import (
    BOTH_PATHS,
    BURST,
    PATHS,
    PUBLISHES,
    Lab,
    check,
    report,
    run_stream_with_fault,
    worker_delivered_after,
    worker_logged_after,
)
from tests.support.waiting import wait_until


@BOTH_PATHS
@pytest.mark.parametrize("server", ["PostgreSQL", "RabbitMQ", "Redis"])
def test_a_server_restart_loses_no_push(fault_lab: Lab, server: str, path: str) -> None:
    """The database, the broker or Redis (state only: throttling, caches; it keeps nothing on
    disk here, so it comes back empty) restarted (down for 3 s) while sends are in flight."""
    more = 40  # published at once when the server is back (RabbitMQ takes a while to start)
    tenant = fault_lab.add_tenant(server.lower(), PUBLISHES + BURST + more)
    if server == "PostgreSQL":
        tenant.fcm.respond(None, 200, delay=0.1)  # sends in flight when the database goes
        # Shorter than the outage: the senders hand messages and bookkeeping to the broker.
        fault_lab.start(RELAY_DATABASE_RETRY_SECONDS="1", **PATHS[path])
    else:
        fault_lab.start(**PATHS[path])
    offsets: list[int] = []

    def restart() -> float:
        if server == "PostgreSQL":
            fault_lab.postgres.stop(mode="fast")
            time.sleep(3.0)
            fault_lab.postgres.start()
            offsets.extend(worker.log_path.stat().st_size for worker in fault_lab.workers)
        else:
            restarted = fault_lab.redis if server == "Redis" else fault_lab.rabbit
            assert restarted is not None
            offsets.extend(worker.log_path.stat().st_size for worker in fault_lab.workers)
            restarted.stop()
            time.sleep(3.0)  # the outage itself
            restarted.start()
        back = time.time()
        tenant.publish_stream(more, None, start=PUBLISHES + BURST)
        return back

    back_at = run_stream_with_fault(fault_lab, tenant, restart)
    result = report(fault_lab, tenant, f"{server} restart ({path})", back_at)
    check(result, fault_lab)
    # Every worker replaced its dead connections (a broker reconnect never kills one); when
    # they carry the sends, after a database restart each delivers again (after a broker
    # restart one worker may prefetch all that is left). On the direct path the gateway
    # delivered what was published after the fault (`check`: recovery).
    for worker, offset in zip(fault_lab.workers, offsets, strict=True):
        assert worker.alive(), worker.log_text()[-3000:]
        if server == "RabbitMQ":
            wait_until(
                lambda worker=worker, offset=offset: worker_logged_after(
                    worker, offset, "Connected to amqp"
                ),
                timeout=60,
                what=f"{worker.name} reconnected",
            )
        elif path == "workers":
            assert worker_delivered_after(worker, offset) > 0, f"{worker.name} never recovered"


@BOTH_PATHS
def test_the_whole_broker_down_for_20_seconds_loses_no_accepted_push(
    fault_lab: Lab, path: str
) -> None:
    """RabbitMQ stopped for 20 s mid-stream: the gateway answers `wait` (within
    CELERY_CONFIRM_TIMEOUT) for what it cannot queue, and every push answered `result` before,
    during or after is delivered. On the direct path the gateway queues next to nothing at
    this rate: it sends its pushes itself, and answers `result` throughout."""
    more = 40  # published once the broker is back
    tenant = fault_lab.add_tenant("down", PUBLISHES + BURST + more)
    fault_lab.start(**PATHS[path])

    def broker_down() -> float:
        assert fault_lab.rabbit is not None
        fault_lab.rabbit.stop()
        time.sleep(20.0)  # the outage itself
        fault_lab.rabbit.start()
        back = time.time()
        tenant.publish_stream(more, None, start=PUBLISHES + BURST)
        return back

    back_at = run_stream_with_fault(fault_lab, tenant, broker_down)
    result = report(fault_lab, tenant, f"whole broker down 20 s ({path})", back_at)
    check(result, fault_lab)
    if path == "workers":
        assert result.answered_wait > 0, result.line()  # publishes during the outage
    else:
        # A loaded machine may hold several of the app's publishes in one batch (beyond the
        # four the gateway sends itself, direct_sends.JOBS_MAX) or its sends in flight long
        # enough to count as slow: those go to the broker by design, and are answered `wait`
        # while it is down. The rest, nearly all, the gateway sent itself.
        assert result.answered_wait <= len(tenant.sent) // 50, result.line()
    answered = tenant.answers()
    assert len(answered) == len(tenant.sent), "a publish went unanswered"
