"""The delivery engine against the wire-level fakes: every outcome class for each provider,
retries (backoff, Retry-After, quota errors, attempt and age bounds), dead letters and their
replay with the same push id, coalesced sends, payload options and the in-flight cap."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from relay.models import DeadLetter, Delivery, Outcome, Priority, Registration, Service
from relay.providers import limits, registry
from relay.providers.base import SendResult, Wakeup
from relay.services import dead_letters, delivery, queue, throttling
from tests.fakes.fcm import FakeFcm
from tests.fakes.wns import FakeReply, FakeWns
from tests.support.broker import queued_jobs_with_eta
from tests.support.provider_fakes import (
    configure_apns,
    configure_fcm,
    configure_wns,
    start_apns,
)

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
    yield {"fcm": fcm, "apns": apns, "wns": wns}
    registry.close_all()
    throttling.reset()


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
    requeued = queued_jobs_with_eta()
    record = Delivery.objects.filter(push_id=job.push_id).first()
    letter = DeadLetter.objects.filter(push_id=job.push_id).first()
    if outcome == "retry_later":
        [retry] = requeued
        assert retry.job["push_id"] == job.push_id and retry.job["attempt"] == 2
        # Delayed by the backoff: full jitter may pick almost nothing, never the past.
        assert retry.eta is not None and retry.eta >= before
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
    [retry] = queued_jobs_with_eta()
    assert retry.eta >= before + timedelta(seconds=40)


def test_quota_error_without_retry_after_backs_off_for_the_quota_minimum(component, fakes):
    registration = make_registration(component, Service.FCM, fakes)
    fakes["fcm"].respond(registration.token, 429)  # QUOTA_EXCEEDED, no Retry-After
    before = datetime.now(UTC)
    with relay_settings(SEND_QUOTA_MIN_SECONDS=45.0, SEND_RETRY_MAX_SECONDS=300.0):
        assert delivery.deliver(make_job(registration)) == Outcome.RETRY_LATER
    [retry] = queued_jobs_with_eta()
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
    assert queued_jobs_with_eta() == []
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
    assert queued_jobs_with_eta() == []
    assert DeadLetter.objects.get(push_id=job.push_id).reason == "too old: THROTTLED"


def test_a_retry_that_cannot_be_queued_becomes_a_dead_letter(component, fakes, monkeypatch):
    registration = make_registration(component, Service.FCM, fakes)
    fakes["fcm"].respond(registration.token, 503)

    def broker_down(job, **kwargs):
        raise queue.QueueUnavailable

    monkeypatch.setattr(queue, "enqueue_send", broker_down)
    job = make_job(registration)
    assert delivery.deliver(job) == Outcome.FAILED
    assert DeadLetter.objects.get(push_id=job.push_id).reason == "not re-queued: UNAVAILABLE"


def test_unconfigured_provider_is_a_dead_letter(component, fakes):
    registration = make_registration(component, Service.APNS, fakes)
    app = component.app
    app.apns_key = ""
    app.save()
    job = make_job(registration)
    assert delivery.deliver(job) == Outcome.FAILED
    assert DeadLetter.objects.get(push_id=job.push_id).reason == "failed: APNS_NOT_CONFIGURED"


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


# --- the in-flight cap --------------------------------------------------------------------------


class BlockingProvider:
    service = "fcm"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def send(self, wakeup: Wakeup) -> SendResult:
        self.entered.set()
        self.release.wait(10)
        return SendResult.delivered()

    def close(self) -> None:
        pass


def test_sends_beyond_the_in_flight_cap_wait_then_retry_later():
    provider = BlockingProvider()
    wakeup = Wakeup(push_id="p", token="t", account="a")
    results: list[SendResult] = []
    with relay_settings(MAX_IN_FLIGHT_PER_PROVIDER=1, IN_FLIGHT_WAIT_SECONDS=0.05):
        limits.reset()
        try:
            holder = threading.Thread(
                target=lambda: results.append(limits.send_limited(provider, wakeup, service="x"))
            )
            holder.start()
            assert provider.entered.wait(10)
            assert limits.in_flight("x") == 1
            refused = limits.send_limited(provider, wakeup, service="x")
            # Another provider has its own slots.
            other = BlockingProvider()
            other.release.set()
            assert limits.send_limited(other, wakeup, service="y").outcome == Outcome.DELIVERED
            provider.release.set()
            holder.join(10)
        finally:
            provider.release.set()
            limits.reset()
    assert refused == SendResult(Outcome.RETRY_LATER, limits.IN_FLIGHT_CAP)
    assert results == [SendResult.delivered()]
    assert limits.in_flight("x") == 0
