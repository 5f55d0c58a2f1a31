"""The delivery engine against the wire-level fakes: every outcome class for each provider,
retries (backoff, Retry-After, quota errors, attempt and age bounds), dead letters and their
replay with the same push id, coalesced sends, payload options and the in-flight cap."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from relay.models import DeadLetter, Delivery, Priority, Registration, Service
from relay.providers.base import Outcome, SendResult, Wakeup
from relay.services import dead_letters, delivery, queue, throttling
from relay.services import provider_limits as limits
from relay.services import provider_registry as registry
from tests.fakes.fcm import FakeFcm
from tests.fakes.wns import FakeReply, FakeWns
from tests.support.broker import queued_jobs_with_eta
from tests.support.deferred import deferred_jobs
from tests.support.provider_fakes import (
    change_credentials,
    configure_apns,
    configure_fcm,
    configure_wns,
    start_apns,
)
from tests.support.waiting import holds_for, wait_until

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]

OUTCOMES = ["delivered", "dead_token", "retry_later", "failed"]


def relay_settings(**changes: object) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, **changes})


@pytest.fixture(scope="module")
def fcm():
    with FakeFcm() as fake:
        yield fake


@pytest.fixture(scope="module")
def apns_fake():
    fake, key_pem = start_apns()
    yield fake, key_pem
    fake.stop()


@pytest.fixture(scope="module")
def wns():
    with FakeWns() as fake:
        yield fake


@pytest.fixture
def fakes(fcm, apns_fake, wns, component, send_queue):
    """The three fakes, reset, and the component's app pointed at all of them."""
    apns, key_pem = apns_fake
    for fake in (fcm, apns):
        fake.reset()
    app = component.app
    configure_fcm(app, fcm)
    configure_apns(app, apns, key_pem)
    configure_wns(app, wns)
    app.save()
    throttling.reset()
    limits.reset()
    yield {"fcm": fcm, "apns": apns, "wns": wns}
    registry.close_all()
    throttling.reset()
    limits.reset()


_counter = iter(range(10**6))


def make_registration(component, service: str, fakes) -> Registration:
    n = next(_counter)
    if service == Service.FCM:
        token = f"fcm-token-{n}"
    elif service == Service.APNS:
        token = f"{n:064x}"
    else:
        token = fakes["wns"].channel_uri(f"chan{n}")
    return Registration.objects.create(
        app=component.app,
        component=component,
        service=service,
        device_hash=f"{n:040x}",
        account_domain="localhost",
        token=token,
        node=f"node{n}",
        secret="secret",
    )


def make_job(registration: Registration, **changes) -> queue.SendJob:
    now = timezone.now()
    job = queue.SendJob(
        push_id=str(uuid.uuid4()),
        registration_id=registration.pk,
        publishing_domain="localhost",
        important=True,
        message_count=1,
        received=now.isoformat(),
        queued=now.isoformat(),
    )
    return dataclasses.replace(job, **changes)


def wire_requests(service: str, fakes, registration: Registration) -> list:
    if service == Service.WNS:
        return fakes["wns"].requests_for(registration.token.rsplit("/", 1)[1].split("?")[0])
    return fakes[service].requests_for(registration.token)


def script(service: str, fakes, registration: Registration, outcome: str) -> None:
    """Make the provider's fake answer so that `outcome` follows."""
    token = registration.token
    if service == Service.FCM:
        status = {"dead_token": 404, "retry_later": 503, "failed": 403}.get(outcome)
        if status:
            fakes["fcm"].respond(token, status)
    elif service == Service.APNS:
        answer = {
            "dead_token": (410, "Unregistered"),
            "retry_later": (503, "ServiceUnavailable"),
            "failed": (400, "BadCollapseId"),
        }.get(outcome)
        if answer:
            fakes["apns"].respond(token, *answer)
    else:
        status = {"dead_token": 410, "retry_later": 503, "failed": 403}.get(outcome)
        channel = token.rsplit("/", 1)[1].split("?")[0]
        fakes["wns"].set_default_reply(
            channel, FakeReply(status or 200, None if status else "received")
        )


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("service", [Service.FCM, Service.APNS, Service.WNS])
def test_every_outcome_class_for_each_provider(service, outcome, component, fakes):
    registration = make_registration(component, service, fakes)
    script(service, fakes, registration, outcome)
    job = make_job(registration)
    before = datetime.now(UTC)

    assert delivery.deliver(job) == Outcome(outcome)

    assert len(wire_requests(service, fakes, registration)) == 1
    registration.refresh_from_db()
    assert queued_jobs_with_eta() == []  # a retry waits in the database, not the broker
    requeued = deferred_jobs()
    record = Delivery.objects.filter(push_id=job.push_id).first()
    letter = DeadLetter.objects.filter(push_id=job.push_id).first()
    if outcome == "retry_later":
        [retry] = requeued
        assert retry.job["push_id"] == job.push_id and retry.job["attempt"] == 2
        # Delayed by the backoff: full jitter may pick almost nothing, never the past.
        assert retry.eta >= before
        assert record is None and letter is None  # nothing is final yet
        return
    assert requeued == []
    assert record is not None and record.outcome == outcome and record.provider == service
    assert (registration.dead_since is not None) == (outcome == "dead_token")
    assert (registration.last_push is not None) == (outcome == "delivered")
    assert (record.sent is not None) == (outcome == "delivered")
    if outcome == "failed":
        assert letter is not None and letter.reason.startswith("failed: ")
        assert "token" not in letter.job and registration.token not in str(letter.job)
    else:
        assert letter is None


@pytest.mark.parametrize("important", [True, False])
@pytest.mark.parametrize("service", [Service.FCM, Service.APNS, Service.WNS])
def test_important_and_silent_map_to_each_providers_priority(service, important, component, fakes):
    registration = make_registration(component, service, fakes)
    job = make_job(registration, important=important)
    assert delivery.deliver(job) == Outcome.DELIVERED
    [request] = wire_requests(service, fakes, registration)
    if service == Service.FCM:
        assert request.message["android"]["priority"] == ("high" if important else "normal")
    elif service == Service.APNS:
        assert (request.push_type, request.priority) == (
            ("alert", "10") if important else ("background", "5")
        )
        assert request.headers["apns-id"] == job.push_id
    else:
        assert request.headers["x-wns-priority"] == ("1" if important else "3")
    record = Delivery.objects.get(push_id=job.push_id)
    assert record.priority == (Priority.HIGH if important else Priority.NORMAL)


# --- retries ------------------------------------------------------------------------------------


def test_retry_after_is_honoured(component, fakes):
    registration = make_registration(component, Service.FCM, fakes)
    fakes["fcm"].respond(registration.token, 503, retry_after=40)
    before = datetime.now(UTC)
    assert delivery.deliver(make_job(registration)) == Outcome.RETRY_LATER
    [retry] = deferred_jobs()
    assert retry.eta >= before + timedelta(seconds=40)


def test_quota_error_without_retry_after_backs_off_for_the_quota_minimum(component, fakes):
    registration = make_registration(component, Service.FCM, fakes)
    fakes["fcm"].respond(registration.token, 429)  # QUOTA_EXCEEDED, no Retry-After
    before = datetime.now(UTC)
    with relay_settings(SEND_QUOTA_MIN_SECONDS=45.0, SEND_RETRY_MAX_SECONDS=300.0):
        assert delivery.deliver(make_job(registration)) == Outcome.RETRY_LATER
    [retry] = deferred_jobs()
    assert retry.eta >= before + timedelta(seconds=45)


def test_retry_delay_bounds():
    with relay_settings(
        SEND_RETRY_BASE_SECONDS=2.0, SEND_RETRY_MAX_SECONDS=300.0, SEND_QUOTA_MIN_SECONDS=60.0
    ):
        for attempt in range(1, 12):
            ceiling = min(300.0, 2.0 * 2 ** (attempt - 1))
            assert 0 <= delivery.retry_delay(attempt, None) <= ceiling
            assert 30 <= delivery.retry_delay(attempt, 30.0) <= 300.0
            assert 60 <= delivery.retry_delay(attempt, None, quota=True) <= 300.0
        # A provider asking for a day gets the cap, not a day.
        assert delivery.retry_delay(1, 86400.0) == 300.0
        # Jitter: a burst refused together does not come back together.
        assert len({delivery.retry_delay(8, None) for _ in range(20)}) > 1


def test_exhausted_retries_become_a_dead_letter(component, fakes):
    registration = make_registration(component, Service.APNS, fakes)
    fakes["apns"].respond(registration.token, 503, "ServiceUnavailable")
    last = settings.RELAY["SEND_MAX_ATTEMPTS"]
    job = make_job(registration, attempt=last)
    assert delivery.deliver(job) == Outcome.FAILED
    assert queued_jobs_with_eta() == [] and deferred_jobs() == []
    letter = DeadLetter.objects.get(push_id=job.push_id)
    assert letter.reason == "retries exhausted: ServiceUnavailable"
    assert letter.attempts == last and letter.provider == Service.APNS
    record = Delivery.objects.get(push_id=job.push_id)
    assert (record.outcome, record.attempts) == (Outcome.FAILED, last)


def test_a_wake_up_that_would_arrive_too_late_is_given_up(component, fakes):
    registration = make_registration(component, Service.WNS, fakes)
    channel = registration.token.rsplit("/", 1)[1].split("?")[0]
    fakes["wns"].set_default_reply(channel, FakeReply(429, None, {"Retry-After": "120"}))
    max_age = settings.RELAY["SEND_MAX_AGE_SECONDS"]
    received = timezone.now() - timedelta(seconds=max_age - 60)  # 60 s left, 120 s asked
    job = make_job(registration, received=received.isoformat())
    assert delivery.deliver(job) == Outcome.FAILED
    assert queued_jobs_with_eta() == [] and deferred_jobs() == []
    assert DeadLetter.objects.get(push_id=job.push_id).reason == "too old: THROTTLED"


def test_a_job_too_old_to_matter_is_given_up_before_it_is_sent(component, fakes):
    """A wake-up that waited past the age limit (the database or a dead worker held it) is not
    sent hours late: it becomes a dead letter, and the provider never sees it."""
    registration = make_registration(component, Service.FCM, fakes)
    max_age = settings.RELAY["SEND_MAX_AGE_SECONDS"]
    received = timezone.now() - timedelta(seconds=max_age + 1)
    job = make_job(registration, received=received.isoformat())
    assert delivery.deliver(job) == Outcome.FAILED
    assert wire_requests(Service.FCM, fakes, registration) == []
    assert DeadLetter.objects.get(push_id=job.push_id).reason == "too old: not sent"
    assert Delivery.objects.get(push_id=job.push_id).error_code == "TOO_OLD"


def test_a_stuck_provider_is_cut_off_and_its_pushes_end_as_dead_letters(component, fakes):
    """FCM that accepts and never answers: BREAKER_STALLS timeouts, then the app's sends are
    deferred without reaching it (each deferral an attempt), until retries run out."""
    fcm = fakes["fcm"]
    registration = make_registration(component, Service.FCM, fakes)
    fcm.respond(registration.token, 200, delay=5.0)
    with relay_settings(PROVIDER_TIMEOUT_SECONDS=0.2, BREAKER_STALLS=3, BREAKER_SECONDS=60):
        registry.close_all()  # the provider is built with the timeout above
        jobs = [make_job(registration) for _ in range(4)]
        assert [delivery.deliver(job) for job in jobs] == [Outcome.RETRY_LATER] * 4
        assert len(fcm.requests_for(registration.token)) == 3  # the 4th never went out
        retries = {queued.job["push_id"]: queued for queued in deferred_jobs()}
        assert {job.push_id for job in jobs} == set(retries)
        assert all(queued.job["attempt"] == 2 for queued in retries.values())
        # The breaker's time left (60 s), spread over one more, is the send's Retry-After.
        stalled = retries[jobs[3].push_id].eta - timezone.now()
        assert 59 <= stalled.total_seconds() <= 300
        last = make_job(registration, attempt=settings.RELAY["SEND_MAX_ATTEMPTS"])
        assert delivery.deliver(last) == Outcome.FAILED
    letter = DeadLetter.objects.get(push_id=last.push_id)
    assert letter.reason == "retries exhausted: PROVIDER_STALLED"
    assert len(fcm.requests_for(registration.token)) == 3


def test_a_send_deferred_for_a_busy_app_keeps_its_attempt(component, fakes):
    """Deferred for lack of a thread of its app, a send never reached the provider: it comes
    back soon and keeps its attempt number (only the age limit ends it)."""
    registration = make_registration(component, Service.FCM, fakes)
    app = component.app
    stuck = BlockingProvider()  # another thread of this worker, sending to the same app
    with relay_settings(MAX_THREADS_PER_APP=1):
        holder = hold(stuck, limits.Target(app.pk, Service.FCM, app.updated.isoformat()), [])
        limits.task_waiting("another-apps-message", {app.pk + 1})  # so this one steps aside
        try:
            job = make_job(registration, attempt=settings.RELAY["SEND_MAX_ATTEMPTS"])
            assert delivery.deliver(job) == Outcome.RETRY_LATER
        finally:
            limits.task_started("another-apps-message")
            stuck.release.set()
            holder.join(10)
    [queued] = deferred_jobs()
    assert queued.job["push_id"] == job.push_id
    assert queued.job["attempt"] == settings.RELAY["SEND_MAX_ATTEMPTS"]
    # Back once the stuck send has timed out, not after an attempt's backoff.
    timeout = settings.RELAY["PROVIDER_TIMEOUT_SECONDS"]
    assert (queued.eta - timezone.now()).total_seconds() <= 2 * timeout
    assert wire_requests(Service.FCM, fakes, registration) == []


def test_a_deferred_retry_waits_for_the_wal_flush(component, fakes):
    """A deferred send is the only copy of its push once the broker message is acknowledged:
    the batch that writes it commits durably (no `synchronous_commit off`), as for a dead
    letter."""
    registration = make_registration(component, Service.FCM, fakes)
    fakes["fcm"].respond(registration.token, 503)
    with CaptureQueriesContext(connection) as deferring:
        assert delivery.deliver(make_job(registration)) == Outcome.RETRY_LATER
    [_] = deferred_jobs()
    assert not any("synchronous_commit" in sql for sql in queries_sql(deferring))


def test_a_batch_that_writes_a_dead_letter_waits_for_the_wal_flush(component, fakes):
    """Delivery rows may be committed without waiting for the WAL flush (bookkeeping); a dead
    letter may not: it is the only copy of the push once the broker message is acknowledged."""
    registration = make_registration(component, Service.FCM, fakes)
    with CaptureQueriesContext(connection) as delivered:
        assert delivery.deliver(make_job(registration)) == Outcome.DELIVERED
    too_old = timezone.now() - timedelta(seconds=settings.RELAY["SEND_MAX_AGE_SECONDS"] + 1)
    with CaptureQueriesContext(connection) as given_up:
        assert delivery.deliver(make_job(registration, received=too_old.isoformat())) == (
            Outcome.FAILED
        )
    assert DeadLetter.objects.count() == 1
    asynchronous = "SET LOCAL synchronous_commit TO OFF"  # PostgreSQL's: SQLite has none
    on_postgresql = connection.vendor == "postgresql"
    assert any(asynchronous in sql for sql in queries_sql(delivered)) is on_postgresql
    assert not any(asynchronous in sql for sql in queries_sql(given_up))


def test_an_everyday_batch_writes_its_bookkeeping_in_one_round_trip(
    transactional_db, component, fakes
):
    """Sent and recorded: on PostgreSQL the Delivery row and last_push in one simple query (one
    implicit transaction), not BEGIN, SET, UPDATE, INSERT and COMMIT apart. Outside the test's own
    transaction (transactional_db), as in a worker."""
    registration = make_registration(component, Service.FCM, fakes)
    job = make_job(registration)
    with CaptureQueriesContext(connection) as queries:
        assert delivery.deliver(job) == Outcome.DELIVERED
    writes = [sql for sql in queries_sql(queries) if "relay_delivery" in sql]
    assert len(writes) == 1
    [write] = writes
    if connection.vendor == "postgresql":
        assert write.startswith("SET LOCAL synchronous_commit TO OFF; UPDATE")
    else:  # SQLite: one statement per execute, in a transaction as before
        assert write.startswith("INSERT INTO")
    assert Delivery.objects.get(push_id=job.push_id).outcome == Outcome.DELIVERED
    registration.refresh_from_db()
    assert registration.last_push is not None


def test_unconfigured_provider_is_a_dead_letter(component, fakes):
    registration = make_registration(component, Service.APNS, fakes)
    app = component.app
    change_credentials(app, "apns", key="")
    job = make_job(registration)
    assert delivery.deliver(job) == Outcome.FAILED
    assert DeadLetter.objects.get(push_id=job.push_id).reason == "failed: APNS_NOT_CONFIGURED"


def queries_sql(queries: CaptureQueriesContext) -> list[str]:
    return [query["sql"] for query in queries.captured_queries]


def test_an_app_edited_between_two_deliveries_is_seen_by_the_next(component, fakes):
    """The worker keeps apps across batches: an edit must still reach the very next send."""
    registration = make_registration(component, Service.FCM, fakes)
    assert delivery.deliver(make_job(registration)) == Outcome.DELIVERED
    app = component.app
    app.payload_options = {"fcm": {"account_key": "edited"}}
    app.save()
    assert delivery.deliver(make_job(registration)) == Outcome.DELIVERED
    first, second = wire_requests(Service.FCM, fakes, registration)
    assert first.message["data"] == {"account": registration.device_hash}
    assert second.message["data"] == {"edited": registration.device_hash}

    change_credentials(app, "fcm", service_account="")  # credentials removed
    job = make_job(registration)
    assert delivery.deliver(job) == Outcome.FAILED
    assert DeadLetter.objects.get(push_id=job.push_id).reason == "failed: FCM_NOT_CONFIGURED"


def test_a_later_batch_does_not_read_an_unchanged_app_again(component, fakes):
    registration = make_registration(component, Service.FCM, fakes)
    with CaptureQueriesContext(connection) as queries:
        assert delivery.deliver(make_job(registration)) == Outcome.DELIVERED
    app_table = f"FROM {connection.ops.quote_name('relay_app')}"
    assert [sql for sql in queries_sql(queries) if app_table in sql]
    with CaptureQueriesContext(connection) as queries:
        assert delivery.deliver(make_job(registration)) == Outcome.DELIVERED
    assert [sql for sql in queries_sql(queries) if app_table in sql] == []


def test_last_push_moves_once_a_minute_without_an_update_in_between(component, fakes):
    registration = make_registration(component, Service.FCM, fakes)
    recent = timezone.now() - timedelta(seconds=10)
    Registration.objects.filter(pk=registration.pk).update(last_push=recent)
    table = connection.ops.quote_name("relay_registration")
    with CaptureQueriesContext(connection) as queries:
        assert delivery.deliver(make_job(registration)) == Outcome.DELIVERED
    assert [sql for sql in queries_sql(queries) if sql.startswith(f"UPDATE {table}")] == []
    registration.refresh_from_db()
    assert registration.last_push == recent

    old = timezone.now() - timedelta(seconds=delivery.LAST_PUSH_RESOLUTION_SECONDS + 5)
    Registration.objects.filter(pk=registration.pk).update(last_push=old)
    before = timezone.now()
    assert delivery.deliver(make_job(registration)) == Outcome.DELIVERED
    registration.refresh_from_db()
    assert registration.last_push is not None and registration.last_push >= before


# --- dead letters, replays and redeliveries -----------------------------------------------------


def test_replay_requeues_with_the_same_push_id_and_records_one_row(component, fakes):
    registration = make_registration(component, Service.APNS, fakes)
    fakes["apns"].respond(registration.token, 503, "ServiceUnavailable", times=1)
    job = make_job(registration, attempt=settings.RELAY["SEND_MAX_ATTEMPTS"])
    assert delivery.deliver(job) == Outcome.FAILED
    letter = DeadLetter.objects.get(push_id=job.push_id)

    assert dead_letters.replay(dead_letter_ids=[letter.pk]) == 1
    assert dead_letters.replay(dead_letter_ids=[letter.pk]) == 0  # already queued once
    [replayed] = queued_jobs_with_eta()
    assert replayed.job["push_id"] == job.push_id
    assert replayed.job["attempt"] == 1 and replayed.job["replayed"]
    letter.refresh_from_db()
    assert letter.replayed is not None

    assert delivery.deliver(queue.SendJob.from_message(replayed.job)) == Outcome.DELIVERED
    record = Delivery.objects.get(push_id=job.push_id)  # the same row, now delivered
    assert record.outcome == Outcome.DELIVERED and record.sent is not None
    ids = {r.headers["apns-id"] for r in wire_requests(Service.APNS, fakes, registration)}
    assert ids == {job.push_id}


def test_a_replayed_push_failing_again_is_a_dead_letter_again(component, fakes):
    registration = make_registration(component, Service.FCM, fakes)
    fakes["fcm"].respond(registration.token, 403)
    job = make_job(registration)
    delivery.deliver(job)
    letter = DeadLetter.objects.get(push_id=job.push_id)
    dead_letters.replay(dead_letter_ids=[letter.pk])
    [replayed] = queued_jobs_with_eta()
    assert delivery.deliver(queue.SendJob.from_message(replayed.job)) == Outcome.FAILED
    letter.refresh_from_db()
    assert letter.replayed is None  # listed again, replayable again
    assert DeadLetter.objects.filter(push_id=job.push_id).count() == 1


def test_a_redelivered_push_is_recorded_once_and_carries_the_same_id(component, fakes):
    registration = make_registration(component, Service.APNS, fakes)
    job = make_job(registration)
    assert delivery.deliver(job) == Outcome.DELIVERED
    assert delivery.deliver(job) == Outcome.DELIVERED  # e.g. its worker died before the ack
    assert Delivery.objects.filter(push_id=job.push_id).count() == 1
    requests = wire_requests(Service.APNS, fakes, registration)
    assert [r.headers["apns-id"] for r in requests] == [job.push_id, job.push_id]


# --- coalesced sends ----------------------------------------------------------------------------


def test_a_coalesced_send_carries_what_was_folded_into_it(component, fakes):
    registration = make_registration(component, Service.WNS, fakes)
    fold = throttling.Fold
    with relay_settings(COALESCE_SECONDS=30.0):
        tenant = component.tenant
        admit = throttling.admit
        pending = str(uuid.uuid4())
        first = admit(tenant=tenant, registration=registration, push_id="a", fold=fold(False, 1))
        assert first.decision is throttling.Decision.SEND
        scheduled = admit(
            tenant=tenant, registration=registration, push_id=pending, fold=fold(False, 2)
        )
        assert scheduled.decision is throttling.Decision.SCHEDULE
        for count, important in ((3, True), (4, False)):
            folded = admit(
                tenant=tenant,
                registration=registration,
                push_id=str(uuid.uuid4()),
                fold=fold(important, count),
            )
            assert folded.push_id == pending
        job = make_job(registration, push_id=pending, important=False, coalesced=True)
        assert delivery.deliver(job) == Outcome.DELIVERED
    [request] = wire_requests(Service.WNS, fakes, registration)
    assert request.headers["x-wns-priority"] == "1"  # one folded publish was important
    assert request.json()["message_count"] == 4  # the latest count
    record = Delivery.objects.get(push_id=pending)
    assert (record.coalesced, record.priority) == (2, Priority.HIGH)


# --- payload options ----------------------------------------------------------------------------


def test_payload_options_shape_each_providers_payload(component, fakes):
    app = component.app
    app.payload_options = {
        "fcm": {"account_key": "acc", "push_id_key": "push_id"},
        "apns": {"push_id_key": "pid", "mutable_content": True, "alert_body": "Open the app"},
        "wns": {"push_id_key": "push_id"},
    }
    app.save()
    jobs = {}
    for service in (Service.FCM, Service.APNS, Service.WNS):
        registration = make_registration(component, service, fakes)
        jobs[service] = (registration, make_job(registration))
        assert delivery.deliver(jobs[service][1]) == Outcome.DELIVERED

    registration, job = jobs[Service.FCM]
    [sent] = wire_requests(Service.FCM, fakes, registration)
    assert sent.message["data"] == {"acc": registration.device_hash, "push_id": job.push_id}
    registration, job = jobs[Service.APNS]
    [sent] = wire_requests(Service.APNS, fakes, registration)
    assert sent.body["pid"] == job.push_id and sent.body["account"] == registration.device_hash
    assert sent.body["aps"]["mutable-content"] == 1
    assert sent.body["aps"]["alert"] == {"title": "New message", "body": "Open the app"}
    registration, job = jobs[Service.WNS]
    [sent] = wire_requests(Service.WNS, fakes, registration)
    assert sent.json()["push_id"] == job.push_id


def test_default_payload_is_protocols_1_4(component, fakes):
    registration = make_registration(component, Service.FCM, fakes)
    assert delivery.deliver(make_job(registration)) == Outcome.DELIVERED
    [sent] = wire_requests(Service.FCM, fakes, registration)
    assert sent.message["data"] == {"account": registration.device_hash}


def test_bad_payload_options_fail_loudly_not_silently(component, fakes):
    app = component.app
    app.payload_options = {"fcm": {"acount_key": "typo"}}
    app.save()
    registration = make_registration(component, Service.FCM, fakes)
    job = make_job(registration)
    assert delivery.deliver(job) == Outcome.FAILED
    letter = DeadLetter.objects.get(push_id=job.push_id)
    assert letter.reason == "failed: FCM_BAD_PAYLOAD_OPTIONS"
    assert wire_requests(Service.FCM, fakes, registration) == []


# --- bulkheads and breakers (relay/services/provider_limits.py) ------------------------------


class BlockingProvider:
    """Holds every send until released; answers `answer` (delivered by default)."""

    service = "fcm"

    def __init__(self, answer: SendResult | None = None) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.answer = answer or SendResult.delivered()
        self.sends = 0

    def send(self, wakeup: Wakeup) -> SendResult:
        self.sends += 1
        self.entered.set()
        self.release.wait(10)
        return self.answer

    def close(self) -> None:
        pass


WAKEUP = Wakeup(push_id="p", token="t", account="a")
APP_1 = limits.Target(1, "fcm")
APP_2 = limits.Target(2, "fcm")


@pytest.fixture
def fresh_limits():
    limits.reset()
    yield limits
    limits.set_worker_threads(0)
    limits.reset()


def hold(provider: BlockingProvider, target: limits.Target, results: list) -> threading.Thread:
    """A send to `target` that stays in flight until the provider is released."""
    holder = threading.Thread(
        target=lambda: results.extend(limits.send_group(provider, [WAKEUP], target))
    )
    holder.start()
    assert provider.entered.wait(10)
    return holder


def test_sends_beyond_an_apps_slots_wait_then_retry_later(fresh_limits):
    provider = BlockingProvider()
    results: list[SendResult] = []
    with relay_settings(MAX_IN_FLIGHT_PER_PROVIDER=1, IN_FLIGHT_WAIT_SECONDS=0.05):
        try:
            holder = hold(provider, APP_1, results)
            assert limits.in_flight(APP_1) == 1
            refused = limits.send_group(provider, [WAKEUP], APP_1)
            # Another app has its own slots.
            other = BlockingProvider()
            other.release.set()
            assert limits.send_group(other, [WAKEUP], APP_2) == [SendResult.delivered()]
        finally:
            provider.release.set()
        holder.join(10)
    assert refused == [SendResult(Outcome.RETRY_LATER, limits.IN_FLIGHT_CAP)]
    assert results == [SendResult.delivered()]
    assert limits.in_flight(APP_1) == 0


def test_an_app_holding_its_threads_is_deferred_and_others_go_on(fresh_limits, monkeypatch):
    """A stuck app holds at most MAX_THREADS_PER_APP threads: while another app's message
    waits for a thread, its next send is deferred at once (the thread goes back to the pool),
    and once the stuck send is SLOW_SECONDS old it is told to come back when that send has
    timed out; another app's send goes at once."""
    # Longer than the product's half second: the first deferral must come while the stuck send
    # is younger than this, which a loaded machine needs room for.
    monkeypatch.setattr(limits, "SLOW_SECONDS", 2.0)
    limits.set_worker_threads(4)
    assert limits.max_threads_per_app() == 3  # a quarter stays free for the other apps
    stuck = BlockingProvider()
    results: list[SendResult] = []
    with relay_settings(MAX_THREADS_PER_APP=1, PROVIDER_TIMEOUT_SECONDS=5.0):
        try:
            before_hold = time.monotonic()
            holder = hold(stuck, APP_1, results)
            held_since = time.monotonic()  # the stuck send began between these two
            healthy = BlockingProvider()
            healthy.release.set()
            assert limits.send_group(healthy, [WAKEUP], APP_2) == [SendResult.delivered()]
            limits.task_waiting("app-2-message", {APP_2.app})
            started = time.monotonic()
            busy = limits.send_group(stuck, [WAKEUP, WAKEUP], APP_1)
            waited = time.monotonic() - started
            wait_until(
                lambda: time.monotonic() - held_since >= limits.SLOW_SECONDS,
                what="the stuck send is SLOW_SECONDS old",
            )
            slow = limits.send_group(stuck, [WAKEUP], APP_1)
            stuck_for = time.monotonic() - before_hold  # at least the stuck send's age
        finally:
            stuck.release.set()
        holder.join(10)
    assert busy == [SendResult(Outcome.RETRY_LATER, limits.APP_IN_FLIGHT_CAP)] * 2
    assert waited < limits.SLOW_SECONDS
    [deferred] = slow
    assert (deferred.outcome, deferred.error_code) == (
        Outcome.RETRY_LATER,
        limits.APP_IN_FLIGHT_CAP,
    )
    # Until the stuck send has timed out (5 s after it started), spread over one more.
    assert max(limits.SLOW_SECONDS, 5.0 - stuck_for) <= deferred.retry_after <= 10.0
    assert stuck.sends == 1


def test_a_busy_app_with_quick_sends_waits_for_a_thread(fresh_limits):
    """Every slot taken by sends that end quickly, no other app waiting: the next one waits
    for a slot instead of going back through the broker."""
    quick = BlockingProvider()
    results: list[SendResult] = []
    with relay_settings(MAX_THREADS_PER_APP=1):
        holder = hold(quick, APP_1, results)
        threading.Timer(0.1, quick.release.set).start()
        assert limits.send_group(quick, [WAKEUP], APP_1) == [SendResult.delivered()]
        holder.join(10)
    assert results == [SendResult.delivered()] and quick.sends == 2


class QuickProvider:
    """Answers every send after `seconds`, noting when each app's sends arrived."""

    service = "fcm"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.arrived: dict[str, float] = {}
        self.in_flight = 0
        self.peak = 0
        self._lock = threading.Lock()

    def send(self, wakeup: Wakeup) -> SendResult:
        with self._lock:
            self.arrived[wakeup.push_id] = time.monotonic()
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        time.sleep(self.seconds)
        with self._lock:
            self.in_flight -= 1
        return SendResult.delivered()

    def close(self) -> None:
        pass


class Worker:
    """A worker's threads pool as Celery runs it (one FIFO of messages, THREADS threads), the
    worker signals as relay/tasks.py sends them: a message counts as waiting from its arrival
    until a thread takes it. Each message is one wake-up of one app."""

    THREADS = 8
    PREFETCH = 4  # messages reserved ahead per thread (CELERY_WORKER_PREFETCH_MULTIPLIER)

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        limits.set_worker_threads(self.THREADS)
        self.pool = ThreadPoolExecutor(self.THREADS)
        self.results: dict[str, SendResult] = {}
        self.queued: dict[str, float] = {}
        self.reserved = threading.BoundedSemaphore(self.THREADS * self.PREFETCH)

    def receive(self, provider: QuickProvider, app: int, push_id: str) -> None:
        """Like the consumer: waits for room in the prefetch window, then hands it over."""
        self.reserved.acquire()
        self.queued[push_id] = time.monotonic()
        limits.task_waiting(push_id, {app})
        self.pool.submit(self._run, provider, app, push_id)

    def _run(self, provider: QuickProvider, app: int, push_id: str) -> None:
        limits.task_started(push_id)
        try:
            wakeup = dataclasses.replace(WAKEUP, push_id=push_id)
            [self.results[push_id]] = limits.send_group(
                provider, [wakeup], limits.Target(app, "fcm")
            )
        finally:
            self.reserved.release()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def test_a_lone_apps_burst_uses_every_thread_and_is_never_deferred(fresh_limits):
    """One app alone on the worker, a burst far beyond its threads: every send goes out (none
    deferred to the database), and no more than its share send at once."""
    worker = Worker()
    provider = QuickProvider(0.01)
    try:
        for n in range(600):
            worker.receive(provider, APP_1.app, f"a-{n}")
    finally:
        worker.close()
    assert len(worker.results) == 600
    assert set(worker.results.values()) == {SendResult.delivered()}
    assert provider.peak <= limits.max_threads_per_app() < Worker.THREADS
    assert limits.waiting() == {}


OTHERS = 40


def test_another_apps_push_goes_out_quickly_during_a_burst(fresh_limits):
    """App 1 bursts (its sends beyond the share wait in their threads while it is alone);
    app 2's messages arrive behind its reserved ones: each time, the app's sends beyond its
    share step aside, so app 2's wake-up goes out next, not after the app 1 messages reserved
    before it. Counted in sends that start ahead of it, not in milliseconds (a loaded machine
    stretches both alike); the waits are printed."""
    worker = Worker()
    # Each of app 1's sends holds its thread a tenth of a second: a share slot then frees at
    # most once while app 2's wake-up waits for a thread, however loaded the machine.
    burst = QuickProvider(0.1)
    other = QuickProvider(0.0)
    stop = threading.Event()

    def feed() -> None:
        n = 0
        while not stop.is_set():
            worker.receive(burst, APP_1.app, f"a-{n}")
            n += 1

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        wait_until(lambda: burst.peak >= limits.max_threads_per_app(), what="the burst")
        for n in range(OTHERS):
            worker.receive(other, APP_2.app, f"b-{n}")
            wait_until(lambda n=n: f"b-{n}" in other.arrived, what=f"app 2's wake-up {n}")
    finally:
        stop.set()
        feeder.join(30)
        worker.close()
    burst_starts = sorted(burst.arrived.values())
    ahead = []
    for n in range(OTHERS):
        queued, arrived = worker.queued[f"b-{n}"], other.arrived[f"b-{n}"]
        ahead.append(sum(1 for started in burst_starts if queued < started < arrived))
    waits = sorted(other.arrived[f"b-{n}"] - worker.queued[f"b-{n}"] for n in range(OTHERS))
    print(
        f"app 2 during app 1's burst: queued -> provider p50 {waits[OTHERS // 2] * 1000:.1f} ms,"
        f" max {waits[-1] * 1000:.1f} ms; app 1 sends started ahead: max {max(ahead)}"
    )
    # Queued behind the prefetch window (THREADS x PREFETCH app 1 messages) without the step
    # aside, each of app 2's wake-ups would wait for dozens of app 1 sends to start; with it,
    # at most one per share slot that frees meanwhile.
    assert max(ahead) <= limits.max_threads_per_app(), ahead
    assert all(worker.results[f"b-{n}"] == SendResult.delivered() for n in range(OTHERS))
    stepped_aside = [r for r in worker.results.values() if r.outcome == Outcome.RETRY_LATER]
    assert stepped_aside and {r.error_code for r in stepped_aside} == {limits.APP_IN_FLIGHT_CAP}
    assert burst.peak <= limits.max_threads_per_app()


def test_a_send_waiting_for_its_apps_thread_steps_aside_when_another_app_arrives(fresh_limits):
    stuck = BlockingProvider()
    results: list[SendResult] = []
    waited: list[SendResult] = []
    with relay_settings(MAX_THREADS_PER_APP=1, PROVIDER_TIMEOUT_SECONDS=30.0):
        holder = hold(stuck, APP_1, results)
        waiter = threading.Thread(
            target=lambda: waited.extend(limits.send_group(stuck, [WAKEUP], APP_1))
        )
        waiter.start()
        try:
            holds_for(lambda: not waited, 0.3, "the send waits for its app's thread, alone")
            arrived = time.monotonic()
            limits.task_waiting("app-2-message", {APP_2.app})
            waiter.join(10)
            stepped_aside_after = time.monotonic() - arrived
        finally:
            stuck.release.set()
            holder.join(10)
    [aside] = waited
    assert (aside.outcome, aside.error_code) == (Outcome.RETRY_LATER, limits.APP_IN_FLIGHT_CAP)
    assert stepped_aside_after < 1.0
    assert stuck.sends == 1 and results == [SendResult.delivered()]


class ObservedSemaphore(threading.BoundedSemaphore):
    """An app's slots that say when a send has to wait for one."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.waiting = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if super().acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.waiting.set()
        return super().acquire(True, timeout)


def test_a_send_that_waited_for_a_stalled_sends_slot_does_not_follow_it(fresh_limits):
    """The breaker learns a send's stall before its slot is given back: the send that waited
    for that slot finds the breaker open and never reaches the stuck provider."""
    stalled = SendResult(Outcome.RETRY_LATER, "TIMEOUT")
    provider = BlockingProvider(stalled)
    slot = ObservedSemaphore(1)
    limits._slots[APP_1] = slot  # the app's one slot, as _semaphore would make it
    held: list[SendResult] = []
    waited: list[SendResult] = []
    settings = {
        "MAX_IN_FLIGHT_PER_PROVIDER": 1,
        "IN_FLIGHT_WAIT_SECONDS": 30,
        "BREAKER_STALLS": 1,
        "BREAKER_SECONDS": 60,
    }
    with relay_settings(**settings):
        try:
            holder = hold(provider, APP_1, held)
            waiter = threading.Thread(
                target=lambda: waited.extend(limits.send_group(provider, [WAKEUP], APP_1))
            )
            waiter.start()
            assert slot.waiting.wait(10)
        finally:
            provider.release.set()
        holder.join(10)
        waiter.join(10)
    assert held == [stalled]
    [deferred] = waited
    assert (deferred.outcome, deferred.error_code) == (Outcome.RETRY_LATER, limits.PROVIDER_STALLED)
    assert 0 < deferred.retry_after <= 120
    assert provider.sends == 1


def test_a_stalled_provider_opens_its_breaker_and_a_probe_closes_it(fresh_limits):
    stalled = SendResult(Outcome.RETRY_LATER, "TIMEOUT")
    provider = BlockingProvider(stalled)
    provider.release.set()

    def half_open() -> bool:
        return not limits.breaker_open(APP_1)

    # Two seconds open: what is checked while it is open takes milliseconds, with room for a
    # loaded machine; then the test waits for it to half-open rather than sleeping past it.
    with relay_settings(BREAKER_STALLS=3, BREAKER_SECONDS=2.0):
        for _ in range(2):
            assert limits.send_group(provider, [WAKEUP], APP_1) == [stalled]
        before_opening = time.monotonic()
        assert limits.send_group(provider, [WAKEUP], APP_1) == [stalled]
        assert limits.breaker_open(APP_1) and not limits.breaker_open(APP_2)
        # Open: deferred without touching the provider, with the time left as Retry-After.
        [deferred] = limits.send_group(provider, [WAKEUP], APP_1)
        assert (deferred.outcome, deferred.error_code) == (
            Outcome.RETRY_LATER,
            limits.PROVIDER_STALLED,
        )
        assert 0 < deferred.retry_after <= 4.0  # the time left, spread over a cool-down
        assert provider.sends == 3
        wait_until(half_open, timeout=30, what="the breaker half-opens")
        assert time.monotonic() - before_opening >= 1.99  # not before its time
        # Half open: one probe of a batch goes out; it stalls again, so the breaker reopens.
        results = limits.send_group(provider, [WAKEUP, WAKEUP], APP_1)
        assert [r.error_code for r in results] == ["TIMEOUT", limits.PROVIDER_STALLED]
        assert provider.sends == 4 and limits.breaker_open(APP_1)
        wait_until(half_open, timeout=30, what="the breaker half-opens again")
        # Any answer, even a refusal, means the provider is not stuck: closed again.
        provider.answer = SendResult(Outcome.DEAD_TOKEN, "UNREGISTERED")
        assert limits.send_group(provider, [WAKEUP], APP_1)[0].outcome == Outcome.DEAD_TOKEN
        assert not limits.breaker_open(APP_1)
        assert limits.send_group(provider, [WAKEUP, WAKEUP], APP_1) == [provider.answer] * 2
        # A new credential version starts with a fresh breaker.
        provider.answer = stalled
        for _ in range(3):
            limits.send_group(provider, [WAKEUP], APP_1)
        assert limits.breaker_open(APP_1)
        assert not limits.breaker_open(limits.Target(1, "fcm", "rotated"))
