"""A worker killed with SIGKILL in the middle of a batch loses no push.

Real worker processes, the real RabbitMQ broker and a slow fake FCM (so the kill lands while sends
are in flight and more are prefetched). Sends are acknowledged only after they are done
(acks_late), so:

- killing the whole worker (threads pool: the one process; the same holds for a prefork
  parent, which holds the unacknowledged messages) leaves them unacknowledged in RabbitMQ's
  quorum queue, which hands them to the next worker as soon as the dead one's connection
  closed;
- killing a prefork child mid-task makes the parent reject the task with requeue
  (reject_on_worker_lost), so it comes back at once;
- a batch message (relay.send_pushes, as the gateway queues them) comes back whole: the pushes
  it had already sent go out again with their push ids.

Either way every push reaches the provider at least once, a push sent twice carries the same
push id both times, and each push has exactly one Delivery row.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest
from django.conf import settings

from relay.models import Component, Delivery, Registration, Service
from relay.providers.base import Outcome
from relay.services import throttling
from relay.services.publishing import Publish, Verdict, accept_publish, accept_publishes
from tests.fakes.fcm import FakeFcm
from tests.support import broker
from tests.support.deferred import swept
from tests.support.processes import ServiceProcess, service_env, worker_argv
from tests.support.provider_fakes import configure_fcm
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

PUSHES = 40
SLOW_SENDS = 8
SLOW_SECONDS = 1.5


def start_worker(pool: str) -> ServiceProcess:
    argv = worker_argv(pool=pool)
    env = service_env()
    return ServiceProcess(f"worker-{pool}", argv, env)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after the last ")".
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def prepare_kill_run(component: Component, fcm: FakeFcm) -> list[Publish]:
    """PUSHES registered devices, a slow fake FCM, an empty queue: the publishes to make."""
    app = component.app
    configure_fcm(app, fcm)
    app.payload_options = {"fcm": {"push_id_key": "push_id"}}  # the push id on the wire
    app.save()
    registrations = [
        Registration.objects.create(
            app=app,
            component=component,
            service=Service.FCM,
            device_hash=f"{i:040x}",
            account_domain="localhost",
            token=f"kill-token-{i}",
            node=f"kill-node-{i}",
            secret="secret",
        )
        for i in range(PUSHES)
    ]
    broker.purge()
    throttling.reset()
    fcm.respond(None, 200, delay=SLOW_SECONDS, times=SLOW_SENDS)
    return [
        Publish(
            component_id=component.pk,
            publishing_domain="localhost",
            node=registration.node,
            secret="secret",
            important=True,
        )
        for registration in registrations
    ]


def push_ids_at_fake(fcm: FakeFcm) -> list[str]:
    return [r.message["data"]["push_id"] for r in fcm.requests]


@pytest.mark.parametrize("scenario", ["threads-worker", "prefork-children", "threads-batches"])
def test_sigkill_mid_batch_loses_no_push(scenario, component):
    assert settings.CELERY_BROKER_URL.startswith("amqp://"), "needs the RabbitMQ broker"
    with FakeFcm() as fcm:
        publishes = prepare_kill_run(component, fcm)
        if scenario == "threads-batches":
            # As the gateway queues them: batch messages (relay.send_pushes) of 10 pushes.
            for start in range(0, PUSHES, 10):
                verdicts = accept_publishes(publishes[start : start + 10])
                assert verdicts == [Verdict.ACCEPTED] * 10
        else:
            for publish in publishes:
                assert accept_publish(publish) is Verdict.ACCEPTED

        pool = "prefork" if scenario == "prefork-children" else "threads"
        workers = [start_worker(pool)]
        try:
            fcm.wait_for_requests(2, timeout=60)  # sends are in flight (the fake holds them)
            assert Delivery.objects.count() < PUSHES
            if pool == "threads":
                open_at_kill = fcm.open_connections()
                workers[0].kill()
                assert workers[0].process.returncode == -signal.SIGKILL
                # What the worker wrote just before it died is recorded once the fake has read
                # its connections to the end (slow under load), those it opened at the last
                # moment too (no worker is left: every connection open now was its).
                fcm.wait_closed(open_at_kill | fcm.open_connections(), timeout=60)
                wait_until(lambda: fcm.quiet_for(1.0), what="the fake has read everything")
                sent_before_kill = set(push_ids_at_fake(fcm))
                # RabbitMQ gives unacknowledged messages back once the connection is gone.
                workers.append(start_worker(pool))
            else:
                children = children_of(workers[0].process.pid)
                assert children, "prefork children not found"
                open_at_kill = fcm.open_connections()
                for child in children:
                    os.kill(child, signal.SIGKILL)
                # A request a child wrote just before it died may still be on its way (slow
                # under load): it is recorded once the fake has read its connection to the end.
                fcm.wait_closed(open_at_kill, timeout=60)
                sent_before_kill = set(push_ids_at_fake(fcm))
            with contextlib.suppress(TimeoutError):  # the assertions below say what is missing
                wait_until(
                    # Sends deferred meanwhile (the app's threads busy) are swept at once.
                    swept(lambda: delivered_count() >= PUSHES),
                    timeout=90,
                    interval=0.2,
                )
                # Let anything still in flight finish, so the counts below are final.
                wait_until(lambda: broker_is_idle(fcm), timeout=30, interval=0.5)
        finally:
            for worker in workers:
                worker.stop()
            logs = "\n".join(worker.log_text() for worker in workers)

    records = list(Delivery.objects.values_list("push_id", "outcome", "registration_id"))
    sent = push_ids_at_fake(fcm)
    lost = PUSHES - len({str(push_id) for push_id, _, _ in records})
    assert lost == 0, f"{lost} of {PUSHES} pushes lost\n{logs[-3000:]}"
    assert {outcome for _, outcome, _ in records} == {Outcome.DELIVERED}
    assert {str(push_id) for push_id, _, _ in records} == set(sent)
    assert len(set(sent)) == PUSHES  # every push reached the provider
    # The kill landed mid-batch: some pushes went out twice, each time with its push id.
    duplicates = {push_id for push_id in sent if sent.count(push_id) > 1}
    assert duplicates and duplicates <= sent_before_kill
    print(
        f"worker kill ({scenario}): {PUSHES} pushes, {len(sent)} sends,"
        f" {len(duplicates)} sent twice with their push id, {lost} lost"
    )
    per_token: dict[str, set[str]] = defaultdict(set)
    for request in fcm.requests:
        per_token[request.token].add(request.message["data"]["push_id"])
    assert all(len(ids) == 1 for ids in per_token.values())


def broker_is_idle(fcm: FakeFcm) -> bool:
    """No message waits in the queue and the fake saw no new request for a moment."""
    if not fcm.quiet_for(1.0):
        return False
    return broker.depth() == 0


def delivered_count() -> int:
    return Delivery.objects.filter(outcome=Outcome.DELIVERED).count()
