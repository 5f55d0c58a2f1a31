"""Throttling: per-tenant token buckets and per-registration burst coalescing.

The store is exercised on both backends (Redis, and the SQLite file of the embedded defaults),
including many threads racing for one bucket; then through `accept_publish` with the real
broker.
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime

import pytest
from django.conf import settings
from django.db import OperationalError
from django.test import override_settings

from relay.models import Registration, Service
from relay.services import deferred, throttling
from relay.services.publishing import Publish, Verdict, accept_publish, domain_allowed
from relay.services.registrations import register_device
from relay.services.throttling import Decision, Fold, Limit
from relay.services.throttling.redis_store import RedisStore
from tests.support.broker import queued_jobs_with_eta
from tests.support.deferred import deferred_jobs
from tests.support.waiting import wait_until

LONG_WINDOW = 30.0  # long enough that no test depends on timing
UNLIMITED = Limit(rate=0, burst=1)


def relay_settings(**changes: object) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, **changes})


@pytest.fixture(params=[pytest.param("sqlite", marks=pytest.mark.defaults), pytest.param("redis")])
def store(request, tmp_path):
    """A fresh store of each kind, as the module-level functions see it."""
    if request.param == "redis":
        url = settings.RELAY["STATE_URL"]
        assert url.startswith("redis://"), "the Redis store needs RELAY_STATE_URL=redis://"
    else:
        url = f"sqlite:///{tmp_path / 'state.sqlite3'}"
    with relay_settings(STATE_URL=url):
        throttling.reset()
        yield throttling._store()
        throttling.reset()


def new_key() -> str:
    return uuid.uuid4().hex


def push_id() -> str:
    return str(uuid.uuid4())


# --- the store ----------------------------------------------------------------------------------


def test_bucket_admits_its_burst_then_limits(store):
    limit = Limit(rate=0.001, burst=5)
    bucket = new_key()
    decisions = [
        store.admit(bucket, limit, new_key(), 0, push_id(), Fold(True)).decision for _ in range(6)
    ]
    assert decisions == [Decision.SEND] * 5 + [Decision.LIMITED]
    limited = store.admit(bucket, limit, new_key(), 0, push_id(), Fold(True))
    assert limited.delay > 0
    # Another tenant has its own bucket.
    other = store.admit(new_key(), limit, new_key(), 0, push_id(), Fold(True))
    assert other.decision is Decision.SEND


def test_bucket_refills_at_its_rate(store):
    limit = Limit(rate=20, burst=1)
    bucket = new_key()
    assert store.admit(bucket, limit, new_key(), 0, push_id(), Fold(True)).decision is Decision.SEND
    wait_until(
        lambda: (
            store.admit(bucket, limit, new_key(), 0, push_id(), Fold(True)).decision
            is Decision.SEND
        ),
        timeout=5,
        interval=0.01,
    )


def test_bucket_is_exact_under_concurrency(store):
    """Eight threads race for 50 tokens: exactly 50 publishes get through."""
    limit = Limit(rate=0.0001, burst=50)
    bucket = new_key()
    admitted: list[Decision] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def hammer() -> None:
        start.wait()
        for _ in range(25):
            decision = store.admit(bucket, limit, new_key(), 0, push_id(), Fold(True)).decision
            with lock:
                admitted.append(decision)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert admitted.count(Decision.SEND) == 50
    assert admitted.count(Decision.LIMITED) == 150


# --- token buckets of several keys at once (new registrations) ---------------------------------


def buckets(*limits: Limit) -> list[throttling.Bucket]:
    return [throttling.Bucket(new_key(), limit) for limit in limits]


def test_take_tokens_takes_from_every_bucket_or_from_none(store):
    small, large = buckets(Limit(rate=0.0001, burst=2), Limit(rate=0.0001, burst=3))
    assert store.take_tokens([small, large]) is None
    assert store.take_tokens([small, large]) is None
    refused = store.take_tokens([small, large])
    assert refused.bucket == 0 and refused.retry_after > 1000  # 1 token at 0.0001/s
    # Nothing was taken from the large bucket by the refused call: one token is left in it.
    assert store.take_tokens([large]) is None
    assert store.take_tokens([large]).bucket == 0
    # The index names the empty bucket even when it is not the first.
    fresh = throttling.Bucket(new_key(), Limit(rate=0.0001, burst=5))
    assert store.take_tokens([fresh, large]).bucket == 1


def test_take_tokens_refills_at_the_rate(store):
    [bucket] = buckets(Limit(rate=20, burst=1))
    assert store.take_tokens([bucket]) is None
    assert store.take_tokens([bucket]) is not None
    wait_until(lambda: store.take_tokens([bucket]) is None, interval=0.01)


def test_take_tokens_is_exact_under_concurrency(store):
    """Eight threads race for 30 tokens of two buckets: exactly 30 get through."""
    shared = buckets(Limit(rate=0.0001, burst=30), Limit(rate=0.0001, burst=1000))
    taken: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def hammer() -> None:
        start.wait()
        for _ in range(10):
            got = store.take_tokens(shared) is None
            with lock:
                taken.append(got)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert taken.count(True) == 30
    # The second bucket gave exactly as many: 1000 - 30 are left.
    assert store.take_tokens([shared[1]]) is None


def test_take_tokens_skips_unlimited_buckets_and_fails_open(store, monkeypatch):
    unlimited, limited = buckets(UNLIMITED, Limit(rate=0.0001, burst=1))
    assert throttling.take_tokens([unlimited, limited]) is None
    refused = throttling.take_tokens([unlimited, limited])
    assert refused.bucket == 1  # the caller's index, not the store's
    monkeypatch.setattr(throttling, "_down_until", 0.0)
    with relay_settings(STATE_URL="redis://127.0.0.1:1/0"):
        assert throttling.take_tokens([limited]) is None  # no store: admitted


def test_coalescing_sends_once_then_folds_into_one_delayed_send(store):
    window = new_key()
    first = store.admit("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(False, 1))
    assert first.decision is Decision.SEND
    second_id = push_id()
    second = store.admit("", UNLIMITED, window, LONG_WINDOW, second_id, Fold(False, 2, 0))
    assert second.decision is Decision.SCHEDULE
    assert 0 < second.delay <= LONG_WINDOW
    third = store.admit("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(True, 3))
    fourth = store.admit("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(False, 4, 1))
    assert (third.decision, third.push_id) == (Decision.FOLDED, second_id)
    assert (fourth.decision, fourth.push_id) == (Decision.FOLDED, second_id)

    taken = store.take(window, second_id, LONG_WINDOW)
    # The latest counts, and important because one folded publish was (never downgraded).
    assert taken == throttling.Taken(
        important=True, message_count=4, pending_subscription_count=1, folded=2
    )
    assert store.take(window, second_id, LONG_WINDOW) is None  # claimed once
    # The delayed send just went out: the next publish waits for the next window.
    assert store.admit("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(False)).decision is (
        Decision.SCHEDULE
    )


@pytest.fixture
def redis_store():
    with relay_settings(STATE_URL=settings.RELAY["STATE_URL"]):
        throttling.reset()
        store = throttling._store()
        assert isinstance(store, RedisStore), "needs RELAY_STATE_URL=redis://"
        yield store
        throttling.reset()


def test_admit_many_survives_redis_forgetting_its_scripts(redis_store):
    """The batch path runs EVALSHA without asking SCRIPT EXISTS first: after a Redis restart
    or SCRIPT FLUSH it loads the script again and decides as before, nothing decided twice."""
    store = redis_store
    window = new_key()
    asks = [
        throttling.Ask("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(False, n))
        for n in (1, 2, 3)
    ]
    store._client.script_flush()
    first, second, third = store.admit_many(asks)
    assert (first.decision, second.decision) == (Decision.SEND, Decision.SCHEDULE)
    assert (third.decision, third.push_id) == (Decision.FOLDED, asks[1].push_id)
    store._client.script_flush()
    [fourth] = store.admit_many(
        [throttling.Ask("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(False, 4))]
    )
    assert (fourth.decision, fourth.push_id) == (Decision.FOLDED, asks[1].push_id)


def test_silent_publishes_keep_their_counts_when_none_is_given(store):
    window = new_key()
    store.admit("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(False))
    pending = push_id()
    store.admit("", UNLIMITED, window, LONG_WINDOW, pending, Fold(False, 7, 2))
    store.admit("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(False))
    taken = store.take(window, pending, LONG_WINDOW)
    assert taken == throttling.Taken(False, 7, 2, 1)


def test_abandoned_pending_send_absorbs_nothing(store):
    window = new_key()
    store.admit("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(True))
    lost = push_id()
    assert store.admit("", UNLIMITED, window, LONG_WINDOW, lost, Fold(True)).decision is (
        Decision.SCHEDULE
    )
    store.abandon(window, lost)
    again = store.admit("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(True))
    assert again.decision is Decision.SCHEDULE


def test_windows_are_per_registration(store):
    a, b = new_key(), new_key()
    assert store.admit("", UNLIMITED, a, LONG_WINDOW, push_id(), Fold(True)).decision is (
        Decision.SEND
    )
    assert store.admit("", UNLIMITED, b, LONG_WINDOW, push_id(), Fold(True)).decision is (
        Decision.SEND
    )


def test_a_limited_publish_leaves_the_window_alone(store):
    limit = Limit(rate=0.0001, burst=1)
    bucket, window = new_key(), new_key()
    assert store.admit(bucket, limit, window, LONG_WINDOW, push_id(), Fold(True)).decision is (
        Decision.SEND
    )
    assert store.admit(bucket, limit, window, LONG_WINDOW, push_id(), Fold(True)).decision is (
        Decision.LIMITED
    )
    # Nothing was scheduled by the refused publish: the next admitted one schedules.
    assert store.admit("", UNLIMITED, window, LONG_WINDOW, push_id(), Fold(True)).decision is (
        Decision.SCHEDULE
    )


@pytest.mark.defaults
def test_unreachable_store_fails_open_and_is_skipped_for_a_while(component, monkeypatch):
    monkeypatch.setattr(throttling, "_down_until", 0.0)  # restored after the test
    registration = Registration.objects.create(
        app=component.app,
        component=component,
        service=Service.FCM,
        device_hash="a" * 40,
        account_domain="localhost",
        token="t",
        node="node-unreach",
        secret="s",
    )
    with relay_settings(STATE_URL="redis://127.0.0.1:1/0", COALESCE_SECONDS=5.0):
        admission = throttling.admit(
            tenant=component.tenant,
            registration=registration,
            push_id=push_id(),
            fold=Fold(True),
        )
        assert admission.decision is Decision.SEND

        def explode() -> None:
            raise AssertionError("the store was asked again right after it failed")

        monkeypatch.setattr(throttling, "_store", explode)
        again = throttling.admit(
            tenant=component.tenant, registration=registration, push_id=push_id(), fold=Fold(True)
        )
        assert again.decision is Decision.SEND
        assert throttling.take(registration=registration, push_id=push_id()) is None


@pytest.mark.defaults
def test_no_limit_and_no_window_never_touch_the_store(component, monkeypatch):
    def explode() -> None:
        raise AssertionError("the store was used")

    monkeypatch.setattr(throttling, "_store", explode)
    component.tenant.rate_limit_per_second = 0
    registration = Registration(pk=1, node="n")
    with relay_settings(COALESCE_SECONDS=0):
        admission = throttling.admit(
            tenant=component.tenant, registration=registration, push_id=push_id(), fold=Fold(True)
        )
    assert admission.decision is Decision.SEND


@pytest.mark.defaults
def test_tenant_limit_falls_back_to_the_defaults(component):
    tenant = component.tenant
    with relay_settings(TENANT_RATE_PER_SECOND=7.0, TENANT_RATE_BURST=9):
        assert throttling.tenant_limit(tenant) == Limit(7.0, 9)
        tenant.rate_limit_per_second, tenant.rate_limit_burst = 2.5, 3
        assert throttling.tenant_limit(tenant) == Limit(2.5, 3)


@pytest.mark.defaults
@pytest.mark.parametrize(
    ("allowed", "domain", "expected"),
    [
        ("", "anything.org", True),
        ("example.org\nlocalhost", "localhost", True),
        ("example.org\nlocalhost", "LOCALHOST", True),
        ("example.org", "other.org", False),
        ("*.example.org", "chat.example.org", True),
        ("*.example.org", "example.org", False),
        ("*.example.org", "badexample.org", False),
        ("# our customers\nexample.org\n", "example.org", True),
    ],
)
def test_domain_allowed(allowed, domain, expected):
    assert domain_allowed(allowed_domains=allowed, domain=domain) is expected


# --- through accept_publish ---------------------------------------------------------------------


@pytest.fixture
def fresh_state():
    throttling.reset()
    yield
    throttling.reset()


def register(component, n: int = 0) -> Registration:
    register_device(
        component=component,
        service=Service.FCM,
        bare_jid=f"user{n}@localhost",
        device_id=f"dev-{n}",
        token=f"tok-{n}",
    )
    return Registration.objects.get(token=f"tok-{n}")


def publish(component, registration, **changes) -> Verdict:
    values = {
        "component_id": component.pk,
        "publishing_domain": "localhost",
        "node": registration.node,
        "secret": registration.secret,
        "important": False,
        "message_count": 1,
    }
    values.update(changes)
    return accept_publish(Publish(**values))


@pytest.mark.defaults
@pytest.mark.django_db
def test_a_burst_becomes_one_send_now_and_one_at_the_window_end(component, send_queue, fresh_state):
    registration = register(component)
    with relay_settings(COALESCE_SECONDS=LONG_WINDOW):
        verdicts = [
            publish(component, registration, important=(i == 2), message_count=i + 1)
            for i in range(5)
        ]
    assert verdicts == [Verdict.ACCEPTED] * 5  # folded publishes are answered `result` too
    [first] = queued_jobs_with_eta()
    assert not first.job["coalesced"] and first.eta is None
    # The window's delayed send waits in the database until its due time (no countdown).
    [delayed] = deferred_jobs()
    assert delayed.job["coalesced"] is True
    assert delayed.eta > datetime.now(UTC)
    assert first.job["push_id"] != delayed.job["push_id"]
    # What the delayed send will carry once the worker claims it:
    taken = throttling.take(registration=registration, push_id=delayed.job["push_id"])
    assert taken == throttling.Taken(
        important=True, message_count=5, pending_subscription_count=None, folded=3
    )


@pytest.mark.defaults
@pytest.mark.django_db
def test_rate_limit_answers_wait_and_queues_nothing_more(component, send_queue, fresh_state):
    tenant = component.tenant
    tenant.rate_limit_per_second, tenant.rate_limit_burst = 0.001, 2
    tenant.save()
    registrations = [register(component, n) for n in range(3)]
    with relay_settings(COALESCE_SECONDS=0):
        verdicts = [publish(component, r) for r in registrations]
    assert verdicts == [Verdict.ACCEPTED, Verdict.ACCEPTED, Verdict.RATE_LIMITED]
    assert len(send_queue.queued_jobs()) == 2


@pytest.mark.defaults
@pytest.mark.django_db
def test_suspended_tenant_answers_wait_and_keeps_the_registration(
    component, send_queue, fresh_state
):
    registration = register(component)
    component.tenant.suspended = True
    component.tenant.save()
    assert publish(component, registration) is Verdict.UNAVAILABLE
    assert send_queue.queued_jobs() == []
    assert Registration.objects.get(pk=registration.pk).dead_since is None


@pytest.mark.defaults
@pytest.mark.django_db
def test_domain_not_allowed_is_forbidden(component, send_queue, fresh_state):
    registration = register(component)
    component.tenant.allowed_domains = "example.org\n"
    component.tenant.save()
    assert publish(component, registration) is Verdict.FORBIDDEN
    component.tenant.allowed_domains = "example.org\nlocalhost\n"
    component.tenant.save()
    assert publish(component, registration) is Verdict.ACCEPTED
    assert len(send_queue.queued_jobs()) == 1


@pytest.mark.defaults
@pytest.mark.django_db
def test_failed_deferral_answers_wait_and_is_not_folded_into(
    component, send_queue, fresh_state, monkeypatch
):
    registration = register(component)
    real_write = deferred.write
    with relay_settings(COALESCE_SECONDS=LONG_WINDOW):
        assert publish(component, registration) is Verdict.ACCEPTED

        def database_down(rows):
            raise OperationalError("the database went away")

        monkeypatch.setattr(deferred, "write", database_down)
        assert publish(component, registration) is Verdict.UNAVAILABLE
        monkeypatch.setattr(deferred, "write", real_write)
        # Not folded into the send that was never kept: a new delayed send is deferred.
        assert publish(component, registration) is Verdict.ACCEPTED
    assert [q.job["coalesced"] for q in queued_jobs_with_eta()] == [False]
    assert [q.job["coalesced"] for q in deferred_jobs()] == [True]


# --- through the gateway ------------------------------------------------------------------------


@pytest.mark.defaults
@pytest.mark.django_db(transaction=True)
def test_gateway_answers_wait_to_publishes_over_the_rate_and_result_to_folded_ones(
    fresh_state,
):
    """The XMPP answers: a folded publish is `result`, a rate-limited one `wait`
    (resource-constraint), so no server drops the registration (docs/protocols.md 1.3)."""
    from relay.models import App, Component, Tenant
    from tests.support import broker
    from tests.support.component_server import FakeXmppServer, error_of
    from tests.support.processes import start_gateway
    from tests.test_gateway_stanzas import publish_xml

    server = FakeXmppServer("push.localhost", "s3cr3t")
    tenant = Tenant.objects.create(name="limited", rate_limit_per_second=0.001, rate_limit_burst=3)
    app = App.objects.create(tenant=tenant, name="app")
    component = Component.objects.create(
        tenant=tenant, app=app, jid="push.localhost", secret="s3cr3t", port=server.port
    )
    answer = register_device(
        component=component,
        service=Service.FCM,
        bare_jid="alice@localhost",
        device_id="dev-1",
        token="tok-1",
    )
    broker.purge()
    # The workers make every send, so the first one is read off the queue.
    gateway = start_gateway(RELAY_COALESCE_SECONDS="30", RELAY_DIRECT_SEND_SHARE="0")
    try:
        server.wait_connected(gateway=gateway)
        replies = [
            server.request(publish_xml(f"p{i}", answer.node, answer.secret), f"p{i}")
            for i in range(4)
        ]
    finally:
        gateway.stop()
        server.close()
    # 1: sent now, 2: a delayed send at the window's end, 3: folded into it, 4: over the rate.
    assert [r.get("type") for r in replies[:3]] == ["result"] * 3
    assert error_of(replies[3]) == ("wait", "resource-constraint")
    assert [q.job["coalesced"] for q in queued_jobs_with_eta()] == [False]
    assert [q.job["coalesced"] for q in deferred_jobs()] == [True]
