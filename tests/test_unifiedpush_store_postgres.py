"""The PostgreSQL hot path of the store: group commit across threads, one statement per batch,
and the NOTIFY that carries each stored message to the gateway."""

from __future__ import annotations

import base64
import os
import threading
import time

import psycopg
import pytest
from django.db import connection

from relay.models import Tenant
from relay.unifiedpush.models import UnifiedPushDelivery, UnifiedPushMessage
from relay.unifiedpush.services import messages, registration, store
from tests.support.processes import test_database_url
from tests.support.unifiedpush_components import serving_unifiedpush
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def postgres_only():
    assert connection.vendor == "postgresql", (
        "these tests are about PostgreSQL (make test runs them there)"
    )
    messages.reset_limits()


@pytest.fixture
def tokens():
    tenant = Tenant.objects.create(name="pg")
    component = serving_unifiedpush(
        tenant=tenant, jid="up.pg.example", secret="x", endpoint_url="https://p.example"
    )

    def make() -> str:
        return registration.register(
            component_id=component.pk,
            jid="a@pg.example/phone",
            domain="pg.example",
            has_resource=True,
            application=base64.b64encode(os.urandom(32)).decode(),
            instance=base64.b64encode(os.urandom(32)).decode(),
            now=time.time(),
        ).endpoint.rsplit("/", 1)[1]

    return make


def post_concurrently(items, threads=16):
    """[(token, body, topic)] from `threads` threads at once; returns the Accepted answers."""
    answers = [None] * len(items)
    start = threading.Barrier(threads)

    def work(offset):
        start.wait()
        for index in range(offset, len(items), threads):
            token, body, topic = items[index]
            answers[index] = messages.accept(
                token=token, body=body, ttl="600", topic=topic, urgency=None
            )
        connection.close()

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return answers


def test_concurrent_posts_share_statements_and_each_gets_its_own_id(tokens):
    endpoints = [tokens() for _ in range(8)]
    before = (store._group.batches, store._group.items)
    items = [(endpoints[n % 8], f"body {n}".encode(), None) for n in range(400)]
    answers = post_concurrently(items)
    ids = [answer.message_id for answer in answers]
    assert len(set(ids)) == 400
    batches = store._group.batches - before[0]
    assert store._group.items - before[1] == 400
    assert batches < 400, "no batch held more than one message"
    stored = {
        row.pk: messages.open_message(bytes(row.sealed)).body
        for row in UnifiedPushMessage.objects.all()
    }
    assert {stored[answer.message_id] for answer in answers} == {body for _, body, _ in items}
    for (_, body, _), answer in zip(items, answers, strict=True):
        assert stored[answer.message_id] == body


def test_topic_replacement_stays_exact_inside_a_batch(tokens):
    endpoint = tokens()
    items = [(endpoint, f"v{n}".encode(), "same") for n in range(40)]
    post_concurrently(items, threads=8)
    [row] = UnifiedPushMessage.objects.all()
    assert UnifiedPushDelivery.objects.filter(outcome="replaced").count() == 39
    assert messages.open_message(bytes(row.sealed)).body.startswith(b"v")


def test_every_stored_message_is_notified_once_in_batches_under_8000_bytes(tokens):
    endpoints = [tokens() for _ in range(4)]
    received: list[str] = []
    listening = threading.Event()
    stop = threading.Event()

    def listen():
        with psycopg.connect(test_database_url(), autocommit=True) as conn:
            conn.execute(f"LISTEN {store.CHANNEL}")
            listening.set()
            while not stop.is_set():
                for notification in conn.notifies(timeout=0.2):
                    received.append(notification.payload)

    listener = threading.Thread(target=listen)
    listener.start()
    listening.wait(10)
    items = [(endpoints[n % 4], os.urandom(1500 + n), None) for n in range(120)]
    answers = post_concurrently(items)
    try:
        wait_until(
            lambda: sum(p.count("\n") + 1 for p in received) >= 120,
            what=lambda: f"120 notifications ({len(received)} payloads so far)",
        )
    finally:
        stop.set()
    listener.join()
    lines = [line for payload in received for line in payload.split("\n")]
    assert all(len(payload.encode()) < 8000 for payload in received)
    parsed = [store.parse_notify_payload(line) for line in lines]
    assert sorted(p.id for p in parsed) == sorted(a.message_id for a in answers)
    by_id = {p.id: messages.open_message(p.sealed).body for p in parsed}
    for (_, body, _), answer in zip(items, answers, strict=True):
        assert by_id[answer.message_id] == body


def test_group_commit_with_a_gather_window_answers_each_item_its_own_result():
    """The writer's millisecond of gathering (store.GATHER_SECONDS) never mixes up answers,
    and a failed batch fails every item in it."""
    import threading

    from relay.services.groupcommit import GroupCommit

    batches: list[int] = []

    def write(items):
        batches.append(len(items))
        if any(item < 0 for item in items):
            raise ValueError("refused")
        return [item * 2 for item in items]

    group = GroupCommit(write, gather_seconds=0.002)
    results: dict[int, object] = {}

    def submit(item: int) -> None:
        try:
            results[item] = group.submit(item)
        except ValueError as error:
            results[item] = error

    for _ in range(3):
        threads = [threading.Thread(target=submit, args=(i,)) for i in range(1, 33)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == {i: i * 2 for i in range(1, 33)}
    assert sum(batches) == 96
    assert isinstance(group.submit(5), int) and group.submit(6) == 12
    failing = threading.Thread(target=submit, args=(-1,))
    failing.start()
    failing.join()
    assert isinstance(results[-1], ValueError)
