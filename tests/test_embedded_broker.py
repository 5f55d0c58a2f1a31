"""The embedded broker (relay/broker.py) loses nothing when a worker is killed.

First the transport on its own (a real SQLite file, a real kombu Connection): an ack deletes
the row, a requeue or a graceful close hands the same row back, and a lease left behind by a
SIGKILLed process comes back once the visibility timeout has passed. Then the SIGKILL-mid-batch
scenario of tests/test_worker_kill.py, with real workers on the embedded broker: every push
reaches the provider, and a push sent twice carries the same push id both times.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from kombu import Connection

from pushsite.celery import app as celery_app
from relay import broker as relay_broker
from relay.models import Delivery
from relay.providers.base import Outcome
from relay.services.publishing import Verdict, accept_publish, accept_publishes
from tests.fakes.fcm import FakeFcm
from tests.support.deferred import swept
from tests.support.processes import ROOT, ServiceProcess, service_env, worker_argv
from tests.support.waiting import wait_until
from tests.test_worker_kill import children_of, prepare_kill_run, push_ids_at_fake

# The file-backed broker is the embedded defaults' own: the PostgreSQL suite has Redis instead.
pytestmark = [pytest.mark.defaults, pytest.mark.embedded]

QUEUE = "jobs"


@pytest.fixture
def broker_file(tmp_path: Path) -> Path:
    return tmp_path / "relay-broker.sqlite3"


def connect(path: Path, visibility_timeout: int = 3600) -> Connection:
    return Connection(
        f"sqlrelay+sqlite:///{path}", transport_options={"visibility_timeout": visibility_timeout}
    )


def publish(conn: Connection, *bodies: str) -> None:
    queue = conn.SimpleQueue(QUEUE)
    for body in bodies:
        queue.put(body)
    queue.close()


def rows(path: Path) -> list[tuple[int, bool]]:
    """(id, visible) of every message row, straight from the file."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        return [
            (id_, bool(visible))
            for id_, visible in db.execute("SELECT id, visible FROM kombu_message ORDER BY id")
        ]


def take(conn: Connection, queue_name: str = QUEUE):
    """The next message, without waiting; None if there is none."""
    channel = conn.default_channel
    channel.queue_declare(queue_name, durable=True, auto_delete=False)
    return channel.basic_get(queue_name)


def size(conn: Connection) -> int:
    return conn.default_channel.queue_declare(QUEUE, passive=True).message_count


def test_the_url_alias_resolves_to_the_lease_transport_and_sqla_still_works(broker_file):
    with celery_app.connection_for_write(f"sqlrelay+sqlite:///{broker_file}") as conn:
        assert isinstance(conn.transport, relay_broker.Transport)
    with Connection(f"sqla+sqlite:///{broker_file.with_name('plain.sqlite3')}") as conn:
        assert not isinstance(conn.transport, relay_broker.Transport)
        publish(conn, "plain")
        assert take(conn).decode() == "plain"


def test_an_ack_deletes_the_row(broker_file):
    with connect(broker_file) as conn:
        publish(conn, "one", "two")
        message = take(conn)
        assert message.decode() == "one"
        assert rows(broker_file) == [(1, False), (2, True)]
        assert size(conn) == 1
        message.ack()
        assert rows(broker_file) == [(2, True)]


def test_a_reject_without_requeue_deletes_the_row(broker_file):
    with connect(broker_file) as conn:
        publish(conn, "one")
        take(conn).reject()
        assert rows(broker_file) == []
        assert take(conn) is None


def test_a_requeue_hands_the_same_row_back(broker_file):
    with connect(broker_file) as conn:
        publish(conn, "one", "two")
        first = take(conn)
        first.requeue()
        assert rows(broker_file) == [(1, True), (2, True)]
        again = take(conn)
        assert again.decode() == "one"
        assert again.delivery_info["redelivered"] is True
        assert again.delivery_tag != first.delivery_tag  # a new lease, a new tag
        again.ack()
        second = take(conn)
        assert second.decode() == "two"
        second.ack()
        assert take(conn) is None
        assert rows(broker_file) == []


def test_closing_with_unacked_messages_makes_them_visible_again(broker_file):
    with connect(broker_file) as conn:
        publish(conn, "one", "two", "three")
        take(conn)
        take(conn).ack()
        take(conn)
        assert size(conn) == 0
    assert rows(broker_file) == [(1, True), (3, True)]  # no new rows
    with connect(broker_file) as conn:
        assert size(conn) == 2
        assert [take(conn).decode(), take(conn).decode()] == ["one", "three"]


def test_a_killed_consumers_lease_expires_and_the_message_comes_back(broker_file, monkeypatch):
    with connect(broker_file) as conn:
        publish(conn, "one", "two")
    # Another process takes both messages and dies without a word (no ack, no close).
    script = (
        "import os, signal\n"
        "from kombu import Connection\n"
        "from relay import broker\n"
        "broker.register()\n"
        f"conn = Connection('sqlrelay+sqlite:///{broker_file}')\n"
        f"ch = conn.default_channel; ch.queue_declare({QUEUE!r})\n"
        f"assert ch.basic_get({QUEUE!r}) and ch.basic_get({QUEUE!r})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=False)
    assert child.returncode == -signal.SIGKILL
    assert rows(broker_file) == [(1, False), (2, False)]
    with connect(broker_file) as conn:
        assert take(conn) is None  # leased, and the lease (an hour) still runs
        assert size(conn) == 0
        later = datetime.datetime.now(datetime.UTC).replace(tzinfo=None) + datetime.timedelta(
            seconds=3601
        )
        monkeypatch.setattr(relay_broker, "_utcnow", lambda: later)
        first, second = take(conn), take(conn)
        assert [first.decode(), second.decode()] == ["one", "two"]
        assert first.delivery_info["redelivered"] is True
        first.ack()
        second.ack()
    assert rows(broker_file) == []


def test_an_expired_lease_cannot_requeue_a_row_leased_again(broker_file, monkeypatch):
    with connect(broker_file) as slow, connect(broker_file) as fresh:
        publish(slow, "one")
        stale = take(slow)
        later = datetime.datetime.now(datetime.UTC).replace(tzinfo=None) + datetime.timedelta(
            seconds=3601
        )
        monkeypatch.setattr(relay_broker, "_utcnow", lambda: later)
        current = take(fresh)
        assert current.decode() == "one"
        stale.requeue()  # its lease is gone: the row stays with the current holder
        assert rows(broker_file) == [(1, False)]
        assert take(fresh) is None
        current.ack()
    assert rows(broker_file) == []


def test_purge_removes_everything_and_counts_the_waiting(broker_file):
    with connect(broker_file) as conn:
        publish(conn, "one", "two", "three")
        take(conn)
        assert conn.default_channel.queue_purge(QUEUE) == 2
        assert rows(broker_file) == []


def test_a_no_ack_get_removes_the_row(broker_file):
    with connect(broker_file) as conn:
        publish(conn, "one")
        channel = conn.default_channel
        message = channel.basic_get(QUEUE, no_ack=True)
        assert message.decode() == "one"
        assert rows(broker_file) == []


# --- Real workers, SIGKILLed mid-batch, on the embedded broker.

PUSHES = 40
# A killed threads worker's leases run out after this; the test waits for it.
VISIBILITY_TIMEOUT = 4
# Prefork: the parent requeues a killed child's sends (after billiard notices, ~10 s), while
# it holds the rest of its prefetched sends; a lease must outlast that, and must not be
# what brings the sends back within the test's patience.
PREFORK_VISIBILITY_TIMEOUT = 600
SLOW_SENDS = 8
SLOW_SECONDS = 1.5


@pytest.fixture
def embedded_broker(broker_file: Path) -> Iterator[str]:
    """Point this process's Celery app (publishing, tests/support/broker.py) at a fresh
    embedded broker file; the workers get the same URL through their environment."""
    url = f"sqlrelay+sqlite:///{broker_file}"
    conf = celery_app.conf
    saved_options = conf.broker_transport_options

    def reconnect() -> None:
        celery_app._pool = None
        celery_app.amqp._producer_pool = None

    with pytest.MonkeyPatch.context() as patch:
        # Celery reads CELERY_BROKER_URL from the environment before its configuration.
        patch.setenv("CELERY_BROKER_URL", url)
        patch.setitem(conf, "broker_url", url)
        conf.broker_transport_options = {"visibility_timeout": VISIBILITY_TIMEOUT}
        reconnect()
        try:
            yield url
        finally:
            conf.broker_transport_options = saved_options
    reconnect()


def start_worker(
    pool: str, broker_url: str, visibility_timeout: int, prefetch_multiplier: int = 4
) -> ServiceProcess:
    argv = worker_argv(pool=pool)
    env = service_env(
        CELERY_BROKER_URL=broker_url,
        CELERY_VISIBILITY_TIMEOUT=str(visibility_timeout),
        CELERY_WORKER_PREFETCH_MULTIPLIER=str(prefetch_multiplier),
        RELAY_STATE_URL=settings.RELAY["STATE_URL"],  # the coalescing state this test uses
    )
    return ServiceProcess(f"worker-{pool}", argv, env)


def broker_rows(broker_url: str) -> int:
    """Messages still in the broker: waiting, or taken and not yet acknowledged."""
    path = broker_url.removeprefix("sqlrelay+sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT count(*) FROM kombu_message").fetchone()[0]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("scenario", ["threads-worker", "prefork-children", "threads-batches"])
def test_sigkill_mid_batch_loses_no_push_on_the_embedded_broker(
    scenario, component, embedded_broker
):
    with FakeFcm() as fcm:
        publishes = prepare_kill_run(component, fcm)
        if scenario == "threads-batches":
            # As the gateway queues them: batch messages (relay.send_pushes) of 10 pushes.
            for start in range(0, PUSHES, 10):
                assert accept_publishes(publishes[start : start + 10]) == [Verdict.ACCEPTED] * 10
            assert broker_rows(embedded_broker) == PUSHES // 10
        else:
            for publish in publishes:
                assert accept_publish(publish) is Verdict.ACCEPTED
            assert broker_rows(embedded_broker) == PUSHES

        pool = "prefork" if scenario == "prefork-children" else "threads"
        timeout = PREFORK_VISIBILITY_TIMEOUT if pool == "prefork" else VISIBILITY_TIMEOUT
        workers = [start_worker(pool, embedded_broker, timeout)]
        try:
            fcm.wait_for_requests(2, timeout=60)  # sends are in flight (the fake holds them)
            assert Delivery.objects.count() < PUSHES
            if pool == "threads":
                open_at_kill = fcm.open_connections()
                workers[0].kill()
                assert workers[0].process.returncode == -signal.SIGKILL
                killed_at = time.monotonic()
                # What the worker wrote just before it died is recorded once the fake has read
                # its connections to the end (slow under load).
                fcm.wait_closed(open_at_kill | fcm.open_connections(), timeout=60)
                wait_until(lambda: fcm.quiet_for(1.0), what="the fake has read everything")
                sent_before_kill = set(push_ids_at_fake(fcm))
                # The killed worker's leases run out after the visibility timeout; only then
                # does the next worker take those messages again. (Time itself is the point
                # here: waiting longer on a busy machine changes nothing.)
                time.sleep(max(0.0, VISIBILITY_TIMEOUT + 1 - (time.monotonic() - killed_at)))
                # It prefetches nothing beyond what it runs: its own leases (as short) must not
                # run out while it holds them.
                workers.append(
                    start_worker(pool, embedded_broker, VISIBILITY_TIMEOUT, prefetch_multiplier=1)
                )
            else:
                parent = workers[0].process.pid
                children = children_of(parent)
                assert children, "prefork children not found"
                # The parent is paused, so no new child sends until the fake has recorded
                # every request the killed children wrote: it has once it read their
                # connections to the end (slow under load).
                os.kill(parent, signal.SIGSTOP)
                try:
                    open_at_kill = fcm.open_connections()
                    for child in children:
                        os.kill(child, signal.SIGKILL)
                    fcm.wait_closed(open_at_kill, timeout=60)
                    sent_before_kill = set(push_ids_at_fake(fcm))
                finally:
                    os.kill(parent, signal.SIGCONT)
            with contextlib.suppress(TimeoutError):  # the assertions below say what is missing
                wait_until(
                    # Sends deferred meanwhile (the app's threads busy) are swept at once.
                    swept(lambda: delivered_count() >= PUSHES),
                    timeout=90,
                    interval=0.2,
                )
                # Let anything still in flight finish, so the counts below are final.
                wait_until(lambda: broker_is_idle(fcm, embedded_broker), timeout=30, interval=0.5)
        finally:
            for worker in workers:
                worker.stop()
            logs = "\n".join(worker.log_text() for worker in workers)

    records = list(Delivery.objects.values_list("push_id", "outcome", "registration_id"))
    sent = push_ids_at_fake(fcm)
    lost = PUSHES - len({str(push_id) for push_id, _, _ in records})
    assert lost == 0, f"{lost} of {PUSHES} pushes lost\n{logs[-3000:]}"
    assert {outcome for _, outcome, _ in records} == {Outcome.DELIVERED}
    assert len(records) == PUSHES  # one Delivery row per push, duplicates or not
    assert {str(push_id) for push_id, _, _ in records} == set(sent)
    assert len(set(sent)) == PUSHES  # every push reached the provider
    # The kill landed mid-batch: some pushes went out twice, each time with its push id.
    duplicates = {push_id for push_id in sent if sent.count(push_id) > 1}
    assert duplicates and duplicates <= sent_before_kill
    assert broker_rows(embedded_broker) == 0  # every message was acknowledged and removed
    print(
        f"worker kill on the embedded broker ({scenario}): {PUSHES} pushes, {len(sent)} sends,"
        f" {len(duplicates)} sent twice with their push id, {lost} lost"
    )
    per_token: dict[str, set[str]] = defaultdict(set)
    for request in fcm.requests:
        per_token[request.token].add(request.message["data"]["push_id"])
    assert all(len(ids) == 1 for ids in per_token.values())


def broker_is_idle(fcm: FakeFcm, broker_url: str) -> bool:
    """No message is left in the broker and the fake saw no new request for a moment."""
    return fcm.quiet_for(1.0) and broker_rows(broker_url) == 0


def delivered_count() -> int:
    return Delivery.objects.filter(outcome=Outcome.DELIVERED).count()
