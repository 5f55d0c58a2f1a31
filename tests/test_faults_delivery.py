"""The delivery engine when PostgreSQL goes away under it (real server, real failures).

- a connection the server dropped (`pg_terminate_backend`, what a restart does to every pooled
  connection) is replaced, and the send goes on;
- the database unreachable before the sends (a TCP proxy cut): DatabaseUnavailable, and
  nothing reached the provider, so the whole message can go back to the broker;
- the database lost while the sends are in flight: RecordPending carries what they taught,
  which is written once the database is back, once however often it is written.

PostgreSQL only (SQLite has no server to lose); the worker processes are in test_faults*.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from celery.exceptions import Reject, Retry
from django.db import connection

from relay import tasks
from relay.models import Delivery, Registration, Service
from relay.providers.base import Outcome
from relay.services import delivery, direct_sends, throttling
from relay.services import provider_limits as limits
from relay.services import provider_registry as registry
from relay.services.publishing import Publish, Verdict, plan_publishes
from tests.fakes.fcm import FakeFcm
from tests.support import broker
from tests.support.broker import queued_jobs_with_eta
from tests.support.processes import test_database_url
from tests.support.provider_fakes import configure_fcm
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_until
from tests.test_delivery import make_job, relay_settings

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fcm_registration(component):
    with FakeFcm() as fcm:
        app = component.app
        configure_fcm(app, fcm)
        app.save()
        throttling.reset()
        limits.reset()
        registration = Registration.objects.create(
            app=app,
            component=component,
            service=Service.FCM,
            device_hash="0" * 40,
            account_domain="localhost",
            token="db-fault-token",
            node="db-fault-node",
            secret="secret",
        )
        yield fcm, registration
        registry.close_all()


@contextlib.contextmanager
def database_through(proxy: TcpProxy) -> Iterator[None]:
    """This thread's Django connection goes through `proxy` (to cut it), then back."""
    settings = connection.settings_dict
    saved = settings["HOST"], settings["PORT"]
    connection.close()
    settings["HOST"], settings["PORT"] = "127.0.0.1", proxy.port
    try:
        yield
    finally:
        connection.close()
        settings["HOST"], settings["PORT"] = saved


def proxy_to_database() -> TcpProxy:
    settings = connection.settings_dict
    return TcpProxy(settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 5432))


def test_a_connection_the_server_dropped_is_replaced(fcm_registration):
    fcm, registration = fcm_registration
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        [pid] = cursor.fetchone()
    with psycopg.connect(test_database_url(), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    job = make_job(registration)
    assert delivery.deliver(job) == Outcome.DELIVERED
    assert Delivery.objects.get(push_id=job.push_id).outcome == Outcome.DELIVERED
    assert len(fcm.requests_for(registration.token)) == 1


def test_no_database_before_the_sends_sends_nothing(fcm_registration):
    fcm, registration = fcm_registration
    proxy = proxy_to_database()
    job = make_job(registration)
    try:
        with database_through(proxy), relay_settings(DATABASE_RETRY_SECONDS=0.5):
            proxy.cut()
            started = time.monotonic()
            with pytest.raises(delivery.DatabaseUnavailable):
                delivery.deliver(job)
            assert time.monotonic() - started < 10
            proxy.restore()
            # Back: the same message now goes through on a new connection.
            assert delivery.deliver(job) == Outcome.DELIVERED
    finally:
        proxy.close()
    assert len(fcm.requests_for(registration.token)) == 1


def test_database_lost_during_the_sends_keeps_their_bookkeeping(fcm_registration):
    fcm, registration = fcm_registration
    fcm.respond(registration.token, 200, delay=0.6)
    proxy = proxy_to_database()
    job = make_job(registration)
    try:
        with database_through(proxy), relay_settings(DATABASE_RETRY_SECONDS=0.5):
            timer = threading.Timer(0.3, proxy.cut)  # while the send is in flight
            timer.start()
            with pytest.raises(delivery.RecordPending) as caught:
                delivery.deliver(job)
            timer.join()
    finally:
        proxy.close()
    pending = caught.value
    assert pending.outcomes == [Outcome.DELIVERED]
    assert len(fcm.requests_for(registration.token)) == 1  # sent once, not to be sent again
    assert not Delivery.objects.filter(push_id=job.push_id).exists()
    # What travels through the broker is plain data without the token.
    message = pending.bookkeeping.to_message()
    assert registration.token not in str(message)
    book = delivery.Bookkeeping.from_message(message)
    delivery.record(book)
    delivery.record(book)  # a redelivered record message changes nothing
    record = Delivery.objects.get(push_id=job.push_id)
    assert (record.outcome, record.sent is not None) == (Outcome.DELIVERED, True)
    registration.refresh_from_db()
    assert registration.last_push is not None


def test_a_deferral_the_broker_refuses_is_requeued_not_dropped():
    """Celery turns a retry it cannot publish into a reject WITHOUT requeue (a lost push);
    the send tasks turn it into a requeue."""

    class BrokerDown:
        name = "relay.send_pushes"
        request = SimpleNamespace(retries=3)

        def retry(self, **options: object) -> None:
            raise Reject("broker unreachable", requeue=False)

    with pytest.raises(Reject) as caught:
        tasks._defer(BrokerDown())
    assert caught.value.requeue is True

    class BrokerUp(BrokerDown):
        def retry(self, **options: object) -> None:
            assert options["max_retries"] is None  # retried until the database is back
            assert 0 <= options["countdown"] <= delivery.DATABASE_RETRY_MAX_SECONDS
            raise Retry("deferred")

    with pytest.raises(Retry):
        tasks._defer(BrokerUp())


# --- the gateway's own sends (relay/services/direct_sends.py) ------------------------------------


def _planned(*registrations: Registration) -> tuple[Any, Any]:
    plan = plan_publishes(
        [
            Publish(
                component_id=registration.component_id,
                publishing_domain="localhost",
                node=registration.node,
                secret="secret",
                important=True,
            )
            for registration in registrations
        ],
        claim=lambda app, jobs: jobs,
    )
    [send] = plan.direct
    return plan, send


def _cut_once(proxy: TcpProxy, fcm: FakeFcm, tokens: list[str]) -> threading.Thread:
    """Cut the database while the sends to `tokens` are in flight (FCM has them and holds
    its answers back)."""

    def cut() -> None:
        wait_until(
            lambda: all(fcm.requests_for(token) for token in tokens),
            timeout=30,
            what="the sends reached FCM",
        )
        proxy.cut()

    thread = threading.Thread(target=cut, daemon=True)
    thread.start()
    return thread


def test_a_direct_send_whose_bookkeeping_the_database_lost_keeps_it_in_the_broker(
    fcm_registration, send_queue
):
    fcm, registration = fcm_registration
    plan, send = _planned(registration)
    fcm.respond(registration.token, 200, delay=2.0)
    proxy = proxy_to_database()
    try:
        with database_through(proxy), relay_settings(DATABASE_RETRY_SECONDS=0.5):
            cutter = _cut_once(proxy, fcm, [registration.token])
            assert direct_sends.send_planned(plan, send) == [Verdict.ACCEPTED]
            cutter.join()
    finally:
        proxy.close()
    assert not Delivery.objects.filter(push_id=send.jobs[0].push_id).exists()
    [message] = queued_jobs_with_eta()
    assert message.task == direct_sends.RECORD_OUTCOMES
    assert registration.token not in str(message.job)  # plain data, no token
    delivery.record(delivery.Bookkeeping.from_message(message.job))
    assert Delivery.objects.get(push_id=send.jobs[0].push_id).outcome == Outcome.DELIVERED
    assert len(fcm.requests_for(registration.token)) == 1


def test_a_direct_retry_that_neither_store_took_is_answered_wait(fcm_registration, send_queue):
    """The database lost during the sends and the broker away too: the delivered push is
    `result`, the retry that exists nowhere is `wait` (its server may publish again)."""
    fcm, registration = fcm_registration
    retried = Registration.objects.create(
        app=registration.app,
        component=registration.component,
        service=Service.FCM,
        device_hash="1" * 40,
        account_domain="localhost",
        token="db-fault-retried",
        node="db-fault-retried-node",
        secret="secret",
    )
    plan, send = _planned(registration, retried)
    fcm.respond(registration.token, 200, delay=2.0)
    fcm.respond(retried.token, 503, delay=2.0)
    proxy = proxy_to_database()
    try:
        with database_through(proxy), relay_settings(DATABASE_RETRY_SECONDS=0.5):
            cutter = _cut_once(proxy, fcm, [registration.token, retried.token])
            with broker.away():
                answers = direct_sends.send_planned(plan, send)
            cutter.join()
    finally:
        proxy.close()
    assert answers == [Verdict.ACCEPTED, Verdict.UNAVAILABLE]
    assert queued_jobs_with_eta() == []


def test_a_direct_send_without_the_database_goes_through_the_broker_unsent(
    fcm_registration, send_queue
):
    fcm, registration = fcm_registration
    plan, send = _planned(registration)
    registry.close_all()  # the app must be read again, and the database is away
    proxy = proxy_to_database()
    try:
        with database_through(proxy), relay_settings(DATABASE_RETRY_SECONDS=0.5):
            proxy.cut()
            assert direct_sends.send_planned(plan, send) == [Verdict.ACCEPTED]
    finally:
        proxy.close()
    assert fcm.requests_for(registration.token) == []
    [message] = queued_jobs_with_eta()
    assert (message.task, message.job["push_id"]) == ("relay.send_push", send.jobs[0].push_id)
