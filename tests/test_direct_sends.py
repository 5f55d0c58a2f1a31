"""The gateway sends an everyday push itself (relay/services/direct_sends.py): the publish is
answered once its push is delivered or kept (a deferred retry, a dead letter, a broker
message), never before; what this path cannot keep goes through the broker.

The services against the real database, broker and fake FCM behind the real client; the
gateway process end to end with a real Prosody in test_e2e_relay.py."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import override_settings

from pushsite.celery import app as celery_app
from relay import amqp_publisher
from relay.models import DeadLetter, Delivery, Registration, Service
from relay.providers.base import Outcome, SendResult, Wakeup
from relay.services import direct_sends, provider_limits, queue, throttling
from relay.services import provider_registry as registry
from relay.services.publishing import Verdict, accept_publishes, plan_publishes
from tests.fakes.fcm import FakeFcm
from tests.support.broker import queued_jobs_with_eta
from tests.support.deferred import deferred_jobs
from tests.support.provider_fakes import configure_fcm
from tests.test_batching import publish_for

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]


def relay_settings(**changes: object) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, **changes})


@pytest.fixture
def fcm():
    with FakeFcm() as fake:
        yield fake


@pytest.fixture
def fcm_app(fcm, component, send_queue):
    app = component.app
    configure_fcm(app, fcm)
    app.save()
    throttling.reset()
    provider_limits.reset()
    yield app
    throttling.reset()
    provider_limits.reset()
    registry.close_all()


def make_registration(component, n: int) -> Registration:
    return Registration.objects.create(
        app=component.app,
        component=component,
        service=Service.FCM,
        device_hash=f"{n:040x}",
        account_domain="localhost",
        token=f"direct-token-{n}",
        node=f"direct-node-{n}",
        secret="secret",
    )


def claim_all(app: int, jobs: int) -> int:
    return jobs


def test_an_everyday_push_is_sent_before_its_answer_and_never_queued(component, fcm_app, fcm):
    registration = make_registration(component, 1)
    other = make_registration(component, 2)
    plan = plan_publishes(
        [publish_for(registration), publish_for(other, secret="wrong")], claim=claim_all
    )
    # The wrong secret is answered at once; the good publish waits for its send.
    assert plan.verdicts == [None, Verdict.FORBIDDEN]
    [send] = plan.direct
    assert fcm.requests_for(registration.token) == []
    assert direct_sends.send_planned(plan, send) == [Verdict.ACCEPTED]
    assert plan.verdicts == [Verdict.ACCEPTED, Verdict.FORBIDDEN]
    assert len(fcm.requests_for(registration.token)) == 1
    [record] = Delivery.objects.filter(registration=registration)
    assert (record.outcome, str(record.push_id)) == (Outcome.DELIVERED, send.jobs[0].push_id)
    assert queued_jobs_with_eta() == []


def test_a_repeat_publish_in_the_same_batch_is_deferred_and_answered_at_once(
    component, fcm_app, fcm
):
    registration = make_registration(component, 3)
    plan = plan_publishes(
        [
            publish_for(registration),
            publish_for(registration, message_count=2),  # scheduled: a coalescing window
            publish_for(registration, message_count=3),  # folded into that one
        ],
        claim=claim_all,
    )
    assert plan.verdicts == [None, Verdict.ACCEPTED, Verdict.ACCEPTED]
    [send] = plan.direct
    assert direct_sends.send_planned(plan, send) == [Verdict.ACCEPTED]
    assert len(fcm.requests_for(registration.token)) == 1
    [delayed] = deferred_jobs()
    assert delayed.job["coalesced"] is True
    assert queued_jobs_with_eta() == []


def test_without_a_claim_the_batch_goes_through_the_broker_as_before(component, fcm_app, fcm):
    registration, other = make_registration(component, 4), make_registration(component, 40)
    plan = plan_publishes([publish_for(registration)], claim=lambda app, jobs: 0)
    assert (plan.verdicts, plan.direct) == ([Verdict.ACCEPTED], [])
    assert accept_publishes([publish_for(other)]) == [Verdict.ACCEPTED]
    assert [job.task for job in queued_jobs_with_eta()] == [queue.SEND_PUSH] * 2
    assert fcm.requests_for(registration.token) == []


def test_the_claim_is_asked_once_per_app_with_its_number_of_sends(component, fcm_app, fcm):
    registrations = [make_registration(component, n) for n in (5, 6, 7)]
    asked: list[tuple[int, int]] = []

    def refuse(app: int, jobs: int) -> int:
        asked.append((app, jobs))
        return 0

    plan = plan_publishes([publish_for(r) for r in registrations], claim=refuse)
    assert asked == [(fcm_app.pk, 3)]
    assert (plan.verdicts, plan.direct) == ([Verdict.ACCEPTED] * 3, [])


def test_a_busy_batch_is_sent_here_in_part_and_the_rest_goes_to_the_workers(
    component, fcm_app, fcm
):
    """Pushes arriving fast: the gateway sends the first few of the app's batch beside the
    workers, and answers those after their sends; the rest are answered once in the broker."""
    registrations = [
        make_registration(component, 100 + n) for n in range(direct_sends.JOBS_MAX + 2)
    ]
    sends = direct_sends.Budget(share=1.0, in_flight=8)
    plan = plan_publishes([publish_for(r) for r in registrations], claim=sends.claim)
    mine = direct_sends.JOBS_MAX
    assert plan.verdicts == [None] * mine + [Verdict.ACCEPTED] * 2
    [send] = plan.direct
    assert send.indices == list(range(mine))
    messages = [m.job if isinstance(m.job, list) else [m.job] for m in queued_jobs_with_eta()]
    queued = {job["push_id"] for jobs in messages for job in jobs}
    assert queued and queued.isdisjoint({job.push_id for job in send.jobs})
    assert len(queued) == 2
    assert direct_sends.send_planned(plan, send) == [Verdict.ACCEPTED] * mine
    assert [len(fcm.requests_for(r.token)) for r in registrations] == [1] * mine + [0, 0]


def test_a_busy_batch_the_broker_refuses_sends_its_own_part_and_answers_the_rest_wait(
    component, fcm_app, fcm, monkeypatch
):
    registrations = [
        make_registration(component, 200 + n) for n in range(direct_sends.JOBS_MAX + 2)
    ]

    def broker_down(*args: object, **kwargs: object) -> None:
        raise OSError("connection refused")

    mine = direct_sends.JOBS_MAX
    with monkeypatch.context() as patched:
        # Both ways a message reaches the broker (as in test_batching.py).
        patched.setattr(celery_app, "send_task", broker_down)
        patched.setattr(amqp_publisher.ConfirmedPublisher, "publish", broker_down)
        sends = direct_sends.Budget(share=1.0, in_flight=8)
        plan = plan_publishes([publish_for(r) for r in registrations], claim=sends.claim)
        assert plan.verdicts == [None] * mine + [Verdict.UNAVAILABLE] * 2
        [send] = plan.direct
        assert direct_sends.send_planned(plan, send) == [Verdict.ACCEPTED] * mine
    assert [len(fcm.requests_for(r.token)) for r in registrations] == [1] * mine + [0, 0]
    assert queued_jobs_with_eta() == []


def test_a_provider_asking_for_a_retry_keeps_the_push_as_a_deferred_send(component, fcm_app, fcm):
    registration = make_registration(component, 5)
    fcm.respond(registration.token, 503, retry_after=30)
    plan = plan_publishes([publish_for(registration)], claim=claim_all)
    [send] = plan.direct
    assert direct_sends.send_planned(plan, send) == [Verdict.ACCEPTED]
    [kept] = deferred_jobs()
    assert kept.job["push_id"] == send.jobs[0].push_id
    assert queued_jobs_with_eta() == []


def test_a_refused_push_is_answered_result_as_a_dead_letter(component, fcm_app, fcm):
    registration = make_registration(component, 6)
    fcm.respond(registration.token, 403, "PERMISSION_DENIED")
    plan = plan_publishes([publish_for(registration)], claim=claim_all)
    [send] = plan.direct
    assert direct_sends.send_planned(plan, send) == [Verdict.ACCEPTED]
    assert DeadLetter.objects.filter(registration=registration).count() == 1


# --- the budget: which sends the gateway makes itself ------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 0.0

    def monotonic(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.cpu


def budget(clock: Clock, *, share: float = 0.5, in_flight: int = 4) -> direct_sends.Budget:
    return direct_sends.Budget(
        share=share, in_flight=in_flight, clock=clock.monotonic, cpu=clock.process_time
    )


def test_the_budget_caps_batches_in_flight_and_each_apps_share():
    clock = Clock()
    sends = budget(clock, in_flight=4)
    assert [sends.claim(1), sends.claim(1), sends.claim(1)] == [1, 1, 0]  # half each
    assert [sends.claim(2), sends.claim(2), sends.claim(3)] == [1, 1, 0]  # all 4 held
    sends.release(1)
    assert sends.claim(3) == 1
    assert sends.held() == 4


def test_the_budget_leaves_a_slow_apps_sends_to_the_workers():
    clock = Clock()
    sends = budget(clock, in_flight=8)
    assert sends.claim(1) == 1
    clock.now += provider_limits.SLOW_SECONDS
    assert sends.claim(1) == 0  # its oldest send has taken too long
    assert sends.claim(2) == 1
    sends.release(1)
    assert sends.claim(1) == 1


def test_the_budget_closes_while_the_process_is_busier_than_its_share():
    clock = Clock()
    sends = budget(clock, share=0.5)
    clock.now += direct_sends.WINDOW_SECONDS
    clock.cpu += direct_sends.WINDOW_SECONDS * 0.6  # 60 % of a core over the window
    assert sends.claim(1) == 0
    clock.now += direct_sends.WINDOW_SECONDS
    clock.cpu += direct_sends.WINDOW_SECONDS * 0.2
    assert sends.claim(1) == 1


def test_of_a_batch_of_many_sends_of_one_app_the_gateway_takes_a_few():
    sends = budget(Clock(), in_flight=8)
    assert sends.claim(1, direct_sends.JOBS_MAX + 3) == direct_sends.JOBS_MAX
    assert sends.claim(2, 2) == 2
    assert sends.held() == 2  # batches in flight, whatever their size


def test_a_share_of_zero_sends_nothing_directly():
    assert budget(Clock(), share=0.0).claim(1) == 0
    assert budget(Clock(), in_flight=0).claim(1) == 0


class StallingProvider:
    """A provider that never answers in time, as a stuck one does."""

    def send(self, wakeup: Wakeup) -> SendResult:
        return SendResult(Outcome.RETRY_LATER, "TIMEOUT")

    def close(self) -> None:
        pass


def test_an_open_breaker_sends_the_apps_pushes_through_the_workers():
    provider_limits.reset()
    wakeup = Wakeup(push_id="p", token="t", account="0" * 40)
    try:
        with relay_settings(BREAKER_STALLS=1, BREAKER_SECONDS=60):
            provider_limits.send_group(
                StallingProvider(), [wakeup], provider_limits.Target(7, Service.FCM)
            )
            assert provider_limits.app_breaker_open(7)
            assert budget(Clock()).claim(7) == 0
            assert budget(Clock()).claim(8) == 1
    finally:
        provider_limits.reset()
