"""Batched hot path: the gateway checks and queues publishes in batches (one query, one
throttling round trip, one broker message), and the worker delivers a batch message item by
item. Every publish and every push must end exactly as it would alone."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from pushsite.celery import app as celery_app
from relay import amqp_publisher, tasks
from relay.models import App, DeadLetter, Delivery, Registration, Service
from relay.providers.base import Outcome, SendResult, Wakeup, send_each
from relay.providers.fcm import FcmConfig, FcmProvider
from relay.providers.payloads import FcmPayload
from relay.services import delivery, queue, throttling
from relay.services import provider_registry as registry
from relay.services.publishing import Plan, Publish, Verdict, accept_publishes
from tests.fakes.fcm import FakeFcm
from tests.support.broker import queued_jobs_with_eta
from tests.support.deferred import deferred_jobs
from tests.support.provider_fakes import configure_fcm
from xmppgateway.gateway import PublishBatcher
from xmppgateway.handlers import Unavailable

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]


@dataclasses.dataclass
class Message:
    task: str
    args: Any
    eta: datetime | None


def take_messages() -> list[Message]:
    """Every message waiting in the send queue, with its task name and ETA (consumed)."""
    return [Message(queued.task, queued.job, queued.eta) for queued in queued_jobs_with_eta()]


def relay_settings(**changes: object) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, **changes})


def make_registration(component, n: int, **changes: Any) -> Registration:
    values: dict[str, Any] = {
        "app": component.app,
        "component": component,
        "service": Service.FCM,
        "device_hash": f"{n:040x}",
        "account_domain": "localhost",
        "token": f"batch-token-{n}",
        "node": f"batch-node-{n}",
        "secret": "secret",
    }
    values.update(changes)
    return Registration.objects.create(**values)


def publish_for(registration: Registration, **changes: Any) -> Publish:
    values: dict[str, Any] = {
        "component_id": registration.component_id,
        "publishing_domain": "localhost",
        "node": registration.node,
        "secret": "secret",
        "important": True,
        "message_count": 1,
    }
    values.update(changes)
    return Publish(**values)


@pytest.fixture
def clean_state(send_queue):
    throttling.reset()
    yield send_queue
    throttling.reset()


# --- the gateway's check-and-queue batch --------------------------------------------------------


def test_a_batch_with_mixed_verdicts_answers_each_publish(component, clean_state):
    tenant = component.tenant
    tenant.rate_limit_per_second = 0.001  # no refill during the test
    tenant.rate_limit_burst = 3
    tenant.save()
    first, second, third = (make_registration(component, n) for n in range(3))
    dead = make_registration(component, 3, dead_since=timezone.now())
    other_domain = make_registration(component, 4, account_domain="other.example")

    batch = [
        publish_for(first),  # token 1: sends now
        publish_for(second, important=False),  # token 2: sends now
        publish_for(third, secret="wrong"),  # forbidden, takes no token
        publish_for(first, node="no-such-node"),  # unknown
        publish_for(dead),  # dead token: unknown
        publish_for(other_domain),  # another server's registration: unknown
        publish_for(first, message_count=5),  # token 3: inside the window, scheduled
        publish_for(third),  # no token left
    ]
    verdicts = accept_publishes(batch)

    assert verdicts == [
        Verdict.ACCEPTED,
        Verdict.ACCEPTED,
        Verdict.FORBIDDEN,
        Verdict.UNKNOWN_NODE,
        Verdict.UNKNOWN_NODE,
        Verdict.UNKNOWN_NODE,
        Verdict.ACCEPTED,
        Verdict.RATE_LIMITED,
    ]
    [now] = messages = take_messages()
    assert now.task == "relay.send_pushes"
    # ONE broker message for the sends that go out now, in publish order.
    assert [job["registration_id"] for job in now.args] == [first.pk, second.pk]
    assert [job["important"] for job in now.args] == [True, False]
    assert now.eta is None and all(job["queued"] and job["received"] for job in now.args)
    assert len({job["push_id"] for job in now.args}) == 2
    # The repeat publish is the window's delayed send: in the database until its due time.
    [later] = deferred_jobs()
    assert later.job["registration_id"] == first.pk and later.job["coalesced"] is True
    assert later.job["message_count"] == 5
    assert later.eta > datetime.now(UTC)
    assert "batch-token" not in repr(messages) + repr(later)


def test_a_batch_queues_one_message_per_app(component, clean_state):
    """Sends are acknowledged per message: an app's sends never share a message with another
    app's, whose stuck provider would otherwise hold their bookkeeping."""
    other_app = App.objects.create(tenant=component.tenant, name="other-app")
    first, second = make_registration(component, 30), make_registration(component, 31)
    third = make_registration(component, 32, app=other_app)
    fourth = make_registration(component, 33, app=other_app)
    verdicts = accept_publishes([publish_for(r) for r in (first, third, second, fourth)])
    assert verdicts == [Verdict.ACCEPTED] * 4
    messages = take_messages()
    assert [m.task for m in messages] == ["relay.send_pushes", "relay.send_pushes"]
    per_message = sorted([job["registration_id"] for job in m.args] for m in messages)
    assert per_message == sorted([[first.pk, second.pk], [third.pk, fourth.pk]])


def test_a_publish_folded_into_a_send_of_the_same_batch_is_accepted(component, clean_state):
    registration = make_registration(component, 10)
    verdicts = accept_publishes(
        [
            publish_for(registration),
            publish_for(registration, message_count=2),  # scheduled
            publish_for(registration, message_count=3, important=False),  # folded into it
        ]
    )
    assert verdicts == [Verdict.ACCEPTED] * 3
    [message] = take_messages()
    assert message.task == "relay.send_push" and message.args["coalesced"] is False
    [delayed] = deferred_jobs()
    assert delayed.job["coalesced"] is True


def test_a_batch_the_broker_refuses_answers_all_wait_and_queues_nothing(
    component, clean_state, monkeypatch
):
    first, second = make_registration(component, 20), make_registration(component, 21)

    def broker_down(*args: object, **kwargs: object) -> None:
        raise OSError("connection refused")

    with monkeypatch.context() as patched:
        # Both ways a message reaches the broker: Celery's, and the confirmed direct write on
        # RabbitMQ.
        patched.setattr(celery_app, "send_task", broker_down)
        patched.setattr(amqp_publisher.ConfirmedPublisher, "publish", broker_down)
        verdicts = accept_publishes(
            [
                publish_for(first),
                publish_for(second),
                publish_for(first),  # would be scheduled
                publish_for(first),  # would fold into that
            ]
        )
    assert verdicts == [Verdict.UNAVAILABLE] * 4
    assert take_messages() == []
    # The delayed send that was never queued was abandoned: the next publish schedules a
    # new one instead of folding into nothing.
    assert deferred_jobs() == []
    assert accept_publishes([publish_for(first)]) == [Verdict.ACCEPTED]
    assert take_messages() == []
    [delayed] = deferred_jobs()
    assert delayed.job["coalesced"] is True


def test_a_single_publish_is_a_batch_of_one_on_the_single_task(component, clean_state):
    registration = make_registration(component, 30)
    assert accept_publishes([publish_for(registration)]) == [Verdict.ACCEPTED]
    [message] = take_messages()
    assert message.task == "relay.send_push"
    assert message.args["registration_id"] == registration.pk


def planned(publishes: list[Publish], verdicts: list[Verdict]) -> Plan:
    """What `plan_publishes` returns for a batch whose sends all go through the broker."""
    return Plan(publishes, {}, list(verdicts), [])


def test_the_gateway_batcher_gathers_publishes_into_one_call():
    calls: list[list[Publish]] = []
    answers = [Verdict.ACCEPTED, Verdict.FORBIDDEN, Verdict.RATE_LIMITED]

    async def run_blocking(fn: Any, publishes: list[Publish], **kwargs: Any) -> Plan:
        calls.append(publishes)
        return planned(publishes, answers[: len(publishes)])

    async def scenario() -> list[Verdict]:
        batcher = PublishBatcher(run_blocking, limit=10, window=0.05)
        requests = [
            Publish(
                component_id=1,
                publishing_domain="localhost",
                node=f"n{i}",
                secret="s",
                important=True,
            )
            for i in range(3)
        ]
        return list(await asyncio.gather(*(batcher.accept(r) for r in requests)))

    assert asyncio.run(scenario()) == answers
    assert [[p.node for p in call] for call in calls] == [["n0", "n1", "n2"]]


def test_the_gateway_batcher_flushes_at_its_limit_and_answers_wait_on_outages():
    calls: list[int] = []

    async def run_blocking(fn: Any, publishes: list[Publish], **kwargs: Any) -> Plan:
        calls.append(len(publishes))
        if len(calls) == 2:
            raise Unavailable
        return planned(publishes, [Verdict.ACCEPTED] * len(publishes))

    async def scenario() -> list[Verdict]:
        batcher = PublishBatcher(run_blocking, limit=2, window=10.0)  # the limit flushes
        publish = Publish(
            component_id=1, publishing_domain="d", node="n", secret="s", important=False
        )
        return list(await asyncio.gather(*(batcher.accept(publish) for _ in range(4))))

    verdicts = asyncio.run(scenario())
    assert calls == [2, 2]
    assert verdicts == [Verdict.ACCEPTED] * 2 + [Verdict.UNAVAILABLE] * 2


def test_the_gateway_batcher_sends_at_once_when_idle_and_gathers_while_a_batch_runs():
    """No timer: a lone publish goes out in the same turn; those arriving while its call runs
    wait for it and then go out together, in order."""
    calls: list[list[str]] = []

    async def scenario() -> tuple[list[Verdict], list[list[str]]]:
        gate = asyncio.Event()

        async def run_blocking(fn: Any, publishes: list[Publish], **kwargs: Any) -> Plan:
            calls.append([p.node for p in publishes])
            if len(calls) == 1:
                await gate.wait()
            return planned(publishes, [Verdict.ACCEPTED] * len(publishes))

        batcher = PublishBatcher(run_blocking, limit=10, concurrency=1)  # adaptive

        def publish(node: str) -> Publish:
            return Publish(
                component_id=1, publishing_domain="d", node=node, secret="s", important=False
            )

        first = asyncio.ensure_future(batcher.accept(publish("a")))
        for _ in range(3):
            await asyncio.sleep(0)
        assert calls == [["a"]]  # out at once, nothing else in flight
        later = [asyncio.ensure_future(batcher.accept(publish(n))) for n in ("b", "c", "d")]
        for _ in range(3):
            await asyncio.sleep(0)
        assert calls == [["a"]]  # gathering while the first call runs
        gate.set()
        verdicts = [await first, *(await asyncio.gather(*later))]
        return verdicts, calls

    verdicts, seen = asyncio.run(scenario())
    assert verdicts == [Verdict.ACCEPTED] * 4
    assert seen == [["a"], ["b", "c", "d"]]


# --- the worker's batch task ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fcm():
    with FakeFcm() as fake:
        yield fake


@pytest.fixture
def fcm_app(fcm, component, clean_state):
    fcm.reset()
    app = component.app
    configure_fcm(app, fcm)
    app.payload_options = {"fcm": {"push_id_key": "push_id"}}
    app.save()
    yield fcm
    registry.close_all()


def job_for(registration_id: int, **changes: Any) -> queue.SendJob:
    now = timezone.now().isoformat()
    job = queue.SendJob(
        push_id=str(uuid.uuid4()),
        registration_id=registration_id,
        publishing_domain="localhost",
        important=True,
        message_count=1,
        received=now,
        queued=now,
    )
    return dataclasses.replace(job, **changes)


def test_the_batch_task_records_every_outcome_per_item(component, fcm_app):
    delivered, dead, retry, failed, already_dead = (
        make_registration(component, 40 + n) for n in range(5)
    )
    Registration.objects.filter(pk=already_dead.pk).update(dead_since=timezone.now())
    fcm_app.respond(dead.token, 404)
    fcm_app.respond(retry.token, 503)
    fcm_app.respond(failed.token, 403)
    jobs = [
        job_for(delivered.pk),
        job_for(dead.pk),
        job_for(retry.pk),
        job_for(failed.pk),
        job_for(already_dead.pk),
        job_for(10**9),  # the registration is gone
    ]
    before = datetime.now(UTC)
    with relay_settings(SEND_RETRY_BASE_SECONDS=30.0):
        done = tasks.send_pushes([job.to_message() for job in jobs])
        outcomes = delivery.deliver_many([])  # an empty batch is fine too
    assert done == len(jobs) and outcomes == []

    records = {str(d.push_id): d for d in Delivery.objects.all()}
    assert {push_id: d.outcome for push_id, d in records.items()} == {
        jobs[0].push_id: Outcome.DELIVERED,
        jobs[1].push_id: Outcome.DEAD_TOKEN,
        jobs[3].push_id: Outcome.FAILED,
        jobs[4].push_id: Outcome.DEAD_TOKEN,
    }
    assert records[jobs[4].push_id].error_code == "ALREADY_DEAD"
    for registration in (delivered, dead, failed):
        registration.refresh_from_db()
    assert delivered.last_push is not None and delivered.dead_since is None
    assert dead.dead_since is not None
    assert failed.dead_since is None and failed.last_push is None
    [letter] = DeadLetter.objects.all()
    assert str(letter.push_id) == jobs[3].push_id and letter.reason.startswith("failed: ")
    # The retry is deferred alone, with its push id, the next attempt and a delay.
    assert take_messages() == []
    [retry] = deferred_jobs()
    assert retry.job["push_id"] == jobs[2].push_id and retry.job["attempt"] == 2
    # The delay is drawn with full jitter up to the base: it may be short, never in the past.
    assert before <= retry.eta <= datetime.now(UTC) + timedelta(seconds=30)
    # The provider saw each push id once (the already dead and the gone ones not at all).
    sent = sorted(r.message["data"]["push_id"] for r in fcm_app.requests)
    assert sent == sorted(job.push_id for job in jobs[:4])


def test_a_redelivered_batch_updates_its_rows_and_retries_with_the_same_push_ids(
    component, fcm_app
):
    """acks_late: a worker killed mid-batch gets the whole batch again."""
    registrations = [make_registration(component, 50 + n) for n in range(4)]
    jobs = [job_for(r.pk) for r in registrations]
    fcm_app.respond(registrations[3].token, 503, times=1)  # only the first attempt
    with relay_settings(SEND_RETRY_BASE_SECONDS=30.0):
        first = delivery.deliver_many(jobs)
        second = delivery.deliver_many(jobs)
    assert first == [Outcome.DELIVERED] * 3 + [Outcome.RETRY_LATER]
    assert second == [Outcome.DELIVERED] * 4
    rows = list(Delivery.objects.values_list("push_id", "outcome", "attempts"))
    assert sorted(str(p) for p, _, _ in rows) == sorted(job.push_id for job in jobs)
    assert {outcome for _, outcome, _ in rows} == {Outcome.DELIVERED}
    # The first pass deferred the retry (one row per push id: a second deferral moves it).
    assert take_messages() == []
    [retry] = deferred_jobs()
    assert retry.job["push_id"] == jobs[3].push_id and retry.job["attempt"] == 2
    per_push: dict[str, int] = {}
    for request in fcm_app.requests:
        push_id = request.message["data"]["push_id"]
        per_push[push_id] = per_push.get(push_id, 0) + 1
    assert per_push == {job.push_id: 2 for job in jobs}


def test_retries_exhausted_in_a_batch_become_dead_letters(component, fcm_app):
    ok, tired = make_registration(component, 60), make_registration(component, 61)
    fcm_app.respond(tired.token, 503)
    last = int(settings.RELAY["SEND_MAX_ATTEMPTS"])
    jobs = [job_for(ok.pk), job_for(tired.pk, attempt=last)]
    assert delivery.deliver_many(jobs) == [Outcome.DELIVERED, Outcome.FAILED]
    assert take_messages() == []
    [letter] = DeadLetter.objects.all()
    assert str(letter.push_id) == jobs[1].push_id
    assert letter.reason.startswith("retries exhausted")
    record = Delivery.objects.get(push_id=jobs[1].push_id)
    assert record.outcome == Outcome.FAILED and record.attempts == last


def test_a_coalesced_send_in_a_batch_claims_what_was_folded(component, fcm_app):
    registration = make_registration(component, 70)
    # The window's delayed send and a publish folded into it, as the gateway leaves them.
    accept_publishes([publish_for(registration)])
    accept_publishes([publish_for(registration, important=False, message_count=2)])
    accept_publishes([publish_for(registration, important=False, message_count=7)])
    take_messages()
    [scheduled] = [queued.job for queued in deferred_jobs()]
    assert scheduled["coalesced"] is True
    other = make_registration(component, 71)
    jobs = [queue.SendJob.from_message(scheduled), job_for(other.pk)]
    assert delivery.deliver_many(jobs) == [Outcome.DELIVERED, Outcome.DELIVERED]
    record = Delivery.objects.get(push_id=scheduled["push_id"])
    assert record.coalesced == 1
    [sent] = fcm_app.requests_for(registration.token)[-1:]
    assert sent.message["data"]["push_id"] == scheduled["push_id"]


# --- FCM's batch path -----------------------------------------------------------------------------

SCRIPTS: list[dict[str, Any]] = [
    {"status": 200},
    {"status": 404},  # UNREGISTERED
    {"status": 503, "retry_after": 7},
    {"status": 429},
    {"status": 500},
    {"status": 403},
    {"status": 400, "error_code": "INVALID_ARGUMENT", "field": "message.token"},
    {"status": 400, "error_code": "INVALID_ARGUMENT", "message": "bad collapse key"},
    {"status": 404, "error_code": ""},
]


def scripted_wakeups(fake: FakeFcm, prefix: str) -> list[Wakeup]:
    wakeups = []
    for n, script in enumerate(SCRIPTS):
        token = f"{prefix}-{n}"
        fake.respond(token, **script)
        wakeups.append(Wakeup(push_id=f"{prefix}{n}", token=token, account="a" * 40))
    return [*wakeups, Wakeup(push_id=f"{prefix}-empty", token="", account="a" * 40)]


def test_fcm_send_many_classifies_exactly_as_send(fcm):
    fcm.reset()
    provider = FcmProvider(
        FcmConfig(service_account=fcm.service_account(), endpoint=fcm.url),
        timeout=5.0,
        payload=FcmPayload(push_id_key="push_id"),
    )
    try:
        one_by_one = [provider.send(w) for w in scripted_wakeups(fcm, "single")]
        batched = provider.send_many(scripted_wakeups(fcm, "batch"))
        assert batched == one_by_one
        assert {r.outcome for r in batched} == {
            Outcome.DELIVERED,
            Outcome.DEAD_TOKEN,
            Outcome.RETRY_LATER,
            Outcome.FAILED,
        }
        assert batched[2].retry_after == 7.0
        # The wire message and its headers are the same on both paths.
        single, batch = fcm.requests_for("single-0")[0], fcm.requests_for("batch-0")[0]
        assert batch.message["data"] == {"account": "a" * 40, "push_id": "batch0"}
        same = ("android", "notification", "apns", "webpush")
        assert {k: single.message.get(k) for k in same} == {k: batch.message.get(k) for k in same}
        for name in ("authorization", "content-type", "x-goog-api-format-version"):
            assert {k.lower(): v for k, v in batch.headers.items()}[name] == {
                k.lower(): v for k, v in single.headers.items()
            }[name]
        # A revoked access token: refreshed once, then delivered.
        fcm.revoke_access_tokens()
        fresh = [Wakeup(push_id=f"r{n}", token=f"fresh-{n}", account="b" * 40) for n in range(3)]
        assert provider.send_many(fresh) == [SendResult.delivered()] * 3
        assert all(fcm.requests_for(w.token) for w in fresh)
    finally:
        provider.close()
    assert provider.send_many(fresh) == [SendResult(Outcome.RETRY_LATER, "CLOSED")] * 3


def test_fcm_send_many_times_out_and_loses_the_network_as_send_does(fcm):
    fcm.reset()
    provider = FcmProvider(
        FcmConfig(service_account=fcm.service_account(), endpoint=fcm.url), timeout=0.3
    )
    try:
        fcm.respond("slow", delay=1.5)
        fast = Wakeup(push_id="fast", token="fast", account="a" * 40)
        slow = Wakeup(push_id="slow", token="slow", account="a" * 40)
        assert provider.send_many([fast, slow]) == [
            SendResult.delivered(),
            SendResult(Outcome.RETRY_LATER, "TIMEOUT"),
        ]
    finally:
        provider.close()
    nowhere = FcmProvider(
        FcmConfig(service_account=fcm.service_account(), endpoint="http://127.0.0.1:9"),
        timeout=0.3,
    )
    try:
        nowhere._credential.token = "t"  # skip the token fetch; the send itself fails
        nowhere._credential.expiry = None
        results = nowhere.send_many([fast, slow])
    finally:
        nowhere.close()
    assert results == [SendResult(Outcome.RETRY_LATER, "NETWORK")] * 2


def test_a_provider_without_send_many_has_its_batch_sent_concurrently():
    """A provider without `send_many` (a new one's first version; the four built in have
    one): a batch must not wait one round trip after another."""
    together = threading.Barrier(3, timeout=10)

    class Overlapping:
        service = "new"

        def send(self, wakeup: Wakeup) -> SendResult:
            together.wait()  # breaks (and the send crashes) unless 3 sends are in flight
            return SendResult.delivered()

        def close(self) -> None:
            pass

    wakeups = [Wakeup(push_id=str(n), token=f"t{n}", account="a") for n in range(3)]
    assert send_each(Overlapping(), wakeups) == [SendResult.delivered()] * 3
