"""Deferred sends (relay/services/deferred.py): kept in the database, not as broker countdowns,
and published by the sweep every worker runs once due; at least once through a crash, nothing
lost while the broker is down, and one tenant's backlog never takes another tenant's share of
a sweep."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import DatabaseError, connection
from django.test import override_settings
from django.utils import timezone
from prometheus_client import REGISTRY

from pushsite.celery import app as celery_app
from relay import tasks
from relay.models import App, DeferredSend, Delivery, Registration, Service, Tenant
from relay.providers.base import Outcome
from relay.services import deferred, delivery, observability, queue, throttling, worker_sweeps
from relay.services import provider_registry as registry
from tests.fakes.fcm import FakeFcm
from tests.support.broker import queued_jobs_with_eta
from tests.support.deferred import deferred_jobs
from tests.support.ports import free_port
from tests.support.provider_fakes import configure_fcm
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]


def relay_settings(**changes: object) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, **changes})


@dataclasses.dataclass
class Message:
    task: str
    jobs: list[dict[str, Any]]
    eta: str | None


def take_messages() -> list[Message]:
    """Every message waiting in the send queue (consumed), as a worker would decode it."""
    found: list[Message] = []
    for queued in queued_jobs_with_eta():
        jobs = queued.job if isinstance(queued.job, list) else [queued.job]
        found.append(Message(queued.task, jobs, queued.eta.isoformat() if queued.eta else None))
    return found


@pytest.fixture(scope="module")
def fcm():
    with FakeFcm() as fake:
        yield fake


@pytest.fixture
def fcm_app(fcm, component, send_queue):
    throttling.reset()
    fcm.reset()
    app = component.app
    configure_fcm(app, fcm)
    app.payload_options = {"fcm": {"push_id_key": "push_id"}}
    app.save()
    yield fcm
    registry.close_all()
    throttling.reset()


def make_registration(app: App, n: int) -> Registration:
    component = app.components.first() or app.tenant.components.create(
        app=app, jid=f"push{app.pk}.localhost", secret="s", host="127.0.0.1", port=5347
    )
    return Registration.objects.create(
        app=app,
        component=component,
        service=Service.FCM,
        device_hash=f"{app.pk:08x}{n:032x}",
        account_domain="localhost",
        token=f"deferred-token-{app.pk}-{n}",
        node=f"deferred-node-{app.pk}-{n}",
        secret="secret",
    )


def job_for(registration: Registration, **changes: Any) -> queue.SendJob:
    now = timezone.now().isoformat()
    job = queue.SendJob(
        push_id=str(uuid.uuid4()),
        registration_id=registration.pk,
        publishing_domain="localhost",
        important=True,
        message_count=1,
        received=now,
        queued=now,
    )
    return dataclasses.replace(job, **changes)


def defer(registration: Registration, delay: float = 0.0, **changes: Any) -> queue.SendJob:
    job = job_for(registration, **changes)
    deferred.defer(job, delay, tenant_id=registration.app.tenant_id, app_id=registration.app_id)
    return job


def other_tenant_app(name: str = "other") -> App:
    tenant = Tenant.objects.create(name=name)
    return App.objects.create(tenant=tenant, name=f"{name}-app")


def counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_a_provider_retry_writes_a_row_and_no_countdown(component, fcm_app):
    registration = make_registration(component.app, 1)
    fcm_app.respond(registration.token, 503, retry_after=60)
    job = job_for(registration)
    before = counter("relay_deferred_sends_written_total")
    assert delivery.deliver(job) == Outcome.RETRY_LATER
    assert take_messages() == []  # nothing in the broker, with or without an ETA
    [row] = DeferredSend.objects.all()
    assert str(row.push_id) == job.push_id and row.job["attempt"] == 2
    assert (row.tenant_id, row.app_id) == (component.tenant_id, component.app_id)
    assert row.due >= timezone.now() + timedelta(seconds=59)
    assert "deferred-token" not in str(row.job)
    assert counter("relay_deferred_sends_written_total") == before + 1


def test_a_retry_the_database_could_not_keep_travels_with_the_bookkeeping(
    component, fcm_app, monkeypatch
):
    """The database goes away after the sends: the deferral is part of the bookkeeping the
    task queues as relay.record_outcomes, and becomes its row once that message is run."""
    registration = make_registration(component.app, 10)
    fcm_app.respond(registration.token, 503)
    job = job_for(registration)
    real_record = delivery.record

    def database_gone(book: delivery.Bookkeeping) -> None:
        raise delivery.DatabaseUnavailable("OperationalError")

    monkeypatch.setattr(delivery, "record", database_gone)
    with pytest.raises(delivery.RecordPending) as pending:
        delivery.deliver_many([job])
    monkeypatch.setattr(delivery, "record", real_record)
    assert DeferredSend.objects.count() == 0
    [row] = pending.value.bookkeeping.deferred
    assert row["push_id"] == job.push_id and row["job"]["attempt"] == 2
    # What relay.record_outcomes does with the message once the database is back.
    assert tasks.record_outcomes(pending.value.bookkeeping.to_message()) == 0
    [kept] = deferred_jobs()
    assert kept.job["push_id"] == job.push_id


def test_the_sweep_queues_a_send_once_due_and_it_is_delivered(component, fcm_app):
    registration = make_registration(component.app, 2)
    later = defer(registration, delay=3600)
    due = defer(registration, delay=0)
    before = counter("relay_deferred_sends_published_total")

    swept = deferred.sweep()

    assert (swept.published, swept.tenants, swept.messages) == (1, 1, 1)
    [message] = take_messages()
    assert message.task == "relay.send_push" and message.eta is None  # a batch of one
    assert [job["push_id"] for job in message.jobs] == [due.push_id]
    assert [job.job["push_id"] for job in deferred_jobs()] == [later.push_id]
    assert counter("relay_deferred_sends_published_total") == before + 1
    # What the worker then does with the message: the push is sent, with its push id.
    assert tasks.send_push(message.jobs[0]) == Outcome.DELIVERED.value
    assert Delivery.objects.get(push_id=due.push_id).outcome == Outcome.DELIVERED
    [request] = fcm_app.requests_for(registration.token)
    assert request.message["data"]["push_id"] == due.push_id
    # Nothing else is due: the next sweep publishes nothing.
    assert deferred.sweep().published == 0 and take_messages() == []


def test_the_task_sweeps_and_beat_does_not(component, fcm_app):
    """The workers sweep (relay/services/worker_sweeps.py); the task stays for a one-off run."""
    registration = make_registration(component.app, 3)
    job = defer(registration)
    assert tasks.sweep_deferred_sends() == 1
    [message] = take_messages()
    assert [item["push_id"] for item in message.jobs] == [job.push_id]
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert not scheduled & {"relay.sweep_deferred_sends", "relay.collect_broker_dead_letters"}


@pytest.mark.django_db(transaction=True)
def test_a_workers_sweeper_queues_due_sends_and_outlives_a_failure(component, fcm_app):
    """Every worker runs the sweeper thread: a due row is queued without beat, and a round
    that fails (the database or the broker away) leaves the thread to try again."""
    registration = make_registration(component.app, 4)
    job = defer(registration)
    failures: list[int] = []

    def failing() -> object:
        failures.append(1)
        raise DatabaseError("away")

    sweeper = worker_sweeps.Sweeper(
        [
            worker_sweeps._Duty("failing", 0.05, failing),
            *worker_sweeps.default_duties(),
        ]
    ).start()
    try:
        wait_until(lambda: not deferred_jobs(), timeout=30, what="the worker's sweep")
        wait_until(lambda: len(failures) >= 3, timeout=30, what="rounds after a failure")
    finally:
        sweeper.stop()
    [message] = take_messages()
    assert [item["push_id"] for item in message.jobs] == [job.push_id]


def test_a_crash_between_publish_and_delete_publishes_again(component, fcm_app, monkeypatch):
    """The rows are deleted in the transaction that published them: a sweep that dies after
    the broker took its message leaves them, and the next sweep publishes them again. The push
    goes out twice at most, with one push id, and keeps one Delivery row."""
    registration = make_registration(component.app, 4)
    job = defer(registration)

    class Crash(Exception):
        pass

    def crash(*args: object, **kwargs: object) -> None:
        raise Crash("killed after the publish")

    with monkeypatch.context() as patched:
        patched.setattr(deferred.DeferredSend.objects, "filter", _crash_on_delete(crash))
        with pytest.raises(Crash):
            deferred.sweep()
    assert [item.job["push_id"] for item in deferred_jobs()] == [job.push_id]  # rolled back
    assert deferred.sweep().published == 1
    assert deferred_jobs() == []
    first, second = take_messages()  # the crashed sweep's message, and the new one
    assert first.jobs == second.jobs
    for message in (first, second):
        tasks.send_push(message.jobs[0])
    # A duplicate, told apart by its push id: the provider saw the id twice, one record.
    sent = [r.message["data"]["push_id"] for r in fcm_app.requests_for(registration.token)]
    assert sent == [job.push_id, job.push_id]
    assert Delivery.objects.filter(push_id=job.push_id).count() == 1


def _crash_on_delete(crash: Any) -> Any:
    """DeferredSend.objects.filter whose result crashes on .delete() (the sweep's last step)."""
    real = DeferredSend.objects.filter

    def filter_(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        if "pk__in" in kwargs:
            found.delete = crash
        return found

    return filter_


@contextlib.contextmanager
def broker_at(url: str) -> Iterator[None]:
    """This process's Celery app publishing to `url` (its connection pools dropped, as
    tests/test_embedded_broker.py does), and back."""

    def reconnect() -> None:
        celery_app._pool = None
        celery_app.amqp._producer_pool = None

    with pytest.MonkeyPatch.context() as patch:
        # Celery reads CELERY_BROKER_URL from the environment before its configuration.
        patch.setenv("CELERY_BROKER_URL", url)
        patch.setitem(celery_app.conf, "broker_url", url)
        reconnect()
        try:
            yield
        finally:
            reconnect()


def test_rows_stay_while_the_broker_is_down(component, fcm_app):
    """The broker does not answer (a real connection refused: nothing listens on its port):
    the sweep publishes nothing, deletes nothing, and says so; once the broker is back every
    row goes out, none twice."""
    registration = make_registration(component.app, 5)
    jobs = [defer(registration) for _ in range(3)]
    before = counter("relay_deferred_sweep_failures_total")
    with broker_at(f"amqp://guest:guest@127.0.0.1:{free_port()}//"):
        assert tasks.sweep_deferred_sends() == 0
        with pytest.raises(queue.QueueUnavailable):
            deferred.sweep()
    assert counter("relay_deferred_sweep_failures_total") == before + 1
    assert len(deferred_jobs()) == 3 and take_messages() == []
    # The broker is back: every row goes out, none twice.
    assert tasks.sweep_deferred_sends() == 3
    [message] = take_messages()
    assert sorted(item["push_id"] for item in message.jobs) == sorted(j.push_id for j in jobs)
    assert deferred_jobs() == []


def test_a_sweep_is_bounded_and_shared_between_tenants(component, fcm_app):
    """One tenant's 60 due sends and another's 5: a sweep of 20 takes all 5 of the other
    tenant's and 15 of the backlog, oldest first; later sweeps drain the rest."""
    busy = [make_registration(component.app, 100 + n) for n in range(3)]
    quiet_app = other_tenant_app()
    quiet = make_registration(quiet_app, 1)
    backlog = [defer(busy[n % 3]) for n in range(60)]
    others = [defer(quiet) for _ in range(5)]

    swept = deferred.sweep(limit=20)

    assert (swept.published, swept.tenants) == (20, 2)
    published = [job["push_id"] for message in take_messages() for job in message.jobs]
    assert {job.push_id for job in others} <= set(published)
    assert set(published) - {job.push_id for job in others} == {j.push_id for j in backlog[:15]}
    # Bounded: the rest waits for the next sweeps.
    assert len(deferred_jobs()) == 45
    while deferred.sweep(limit=20).published:
        pass
    assert deferred_jobs() == []
    assert len({job["push_id"] for message in take_messages() for job in message.jobs}) == 45


def test_a_sweep_waits_while_fresh_pushes_fill_the_queue(component, fcm_app):
    """The queue is first in, first out: the backlog is not queued ahead of fresh pushes."""
    registration = make_registration(component.app, 9)
    job = defer(registration)
    before = counter("relay_deferred_sweeps_held_total")
    with relay_settings(DEFERRED_QUEUE_LIMIT=2):
        for _ in range(3):
            queue.enqueue_send(job_for(registration))  # fresh pushes waiting for a worker
        assert deferred.sweep().published == 0
        assert counter("relay_deferred_sweeps_held_total") == before + 1
        assert len(deferred_jobs()) == 1
        fresh = take_messages()  # the workers catch up
        assert len(fresh) == 3 and job.push_id not in str(fresh)
        assert deferred.sweep().published == 1
    [message] = take_messages()
    assert [item["push_id"] for item in message.jobs] == [job.push_id]


def test_a_queue_that_stays_busy_delays_deferred_sends_but_never_starves_them(component, fcm_app):
    """One tenant keeping every worker thread taken keeps the queue busy: the deferred sends
    wait, but those overdue longest still go, a few per sweep, before their age limit."""
    registrations = [make_registration(component.app, 20 + n) for n in range(5)]
    jobs = [defer(registration) for registration in registrations]
    with relay_settings(DEFERRED_QUEUE_LIMIT=2, DEFERRED_SWEEP_BATCH=40):
        for _ in range(3):
            queue.enqueue_send(job_for(registrations[0]))  # the queue stays busy
        assert deferred.sweep().published == 0  # just due: fresh pushes go first
        later = timezone.now() + timedelta(seconds=deferred.STARVED_AFTER_SECONDS + 1)
        assert deferred.sweep(now=later).published == 40 // deferred.HELD_SHARE
        assert deferred.sweep(now=later).published == 2
        assert deferred.sweep(now=later).published == 1
        assert deferred_jobs() == []
    published = [job["push_id"] for message in take_messages() for job in message.jobs]
    assert {job.push_id for job in jobs} <= set(published)


def test_a_send_deferred_again_moves_its_row(component, fcm_app):
    """A redelivered batch defers the same push id again: one row, the new due time."""
    registration = make_registration(component.app, 6)
    job = defer(registration, delay=10)
    deferred.defer(job, 3600, tenant_id=component.tenant_id, app_id=component.app_id)
    [row] = DeferredSend.objects.all()
    assert row.due >= timezone.now() + timedelta(seconds=3500)


def test_the_backlog_gauges(component, fcm_app):
    registration = make_registration(component.app, 7)
    defer(registration, delay=3600)
    for _ in range(2):
        job = job_for(registration)
        deferred.write(
            [
                deferred.row(
                    job,
                    0,
                    tenant_id=component.tenant_id,
                    app_id=component.app_id,
                    now=timezone.now() - timedelta(seconds=90),
                )
            ]
        )
    families = {family.name: family for family in observability.read_state()}
    waiting = {
        (sample.labels["tenant"], sample.labels["state"]): sample.value
        for sample in families["relay_deferred_sends"].samples
    }
    assert waiting == {("example", "due"): 2, ("example", "later"): 1}
    [overdue] = families["relay_deferred_oldest_due_seconds"].samples
    assert 89 <= overdue.value <= 300


@pytest.mark.django_db(transaction=True)
def test_sweeps_side_by_side_take_different_rows(component, fcm_app):
    """On PostgreSQL a sweep skips the rows another sweep holds (SKIP LOCKED) instead of
    waiting for them or publishing them twice. SQLite has one writer at a time; there the
    second sweep runs after the first and finds nothing left."""
    registration = make_registration(component.app, 8)
    jobs = {defer(registration).push_id for _ in range(10)}
    holding, release = threading.Event(), threading.Event()
    held: list[str] = []

    def first_sweep() -> None:
        from django.db import transaction

        try:
            with transaction.atomic():
                held.extend(str(row.push_id) for row in deferred._take(4, timezone.now()))
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    if connection.vendor != "postgresql":
        assert deferred.sweep(limit=4).published == 4
        assert deferred.sweep(limit=100).published == 6
        assert len(take_messages()) == 2
        return
    thread = threading.Thread(target=first_sweep)
    thread.start()
    try:
        assert holding.wait(30)
        swept = deferred.sweep(limit=100)  # does not wait for the held rows
    finally:
        release.set()
        thread.join(30)
    assert swept.published == 6
    published = {job["push_id"] for message in take_messages() for job in message.jobs}
    assert published == jobs - set(held) and len(held) == 4
    assert {item.job["push_id"] for item in deferred_jobs()} == set(held)
