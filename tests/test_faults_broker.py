"""The RabbitMQ queues the relay declares (relay/broker.py), against the session's broker:

- a send taken and not acknowledged comes back, marked redelivered, as soon as the consumer's
  connection is gone (what a killed worker leaves behind), with nothing to wait for;
- a send delivered CELERY_DELIVERY_LIMIT times without an acknowledgement (a poison message)
  is dead-lettered to `<queue>.dead`, not dropped, and the workers' sweep records it among the
  relay's dead letters with its push id, replayable;
- a message in the dead-letter queue that is not a send stays there for an operator.

The worker processes are in test_faults_workers.py and test_worker_kill.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from kombu import Connection

from pushsite.celery import app as celery_app
from relay import broker, conf, tasks
from relay.amqp_publisher import ConfirmedPublisher
from relay.models import DeadLetter, Registration, Service
from relay.services import broker_dead_letters, queue
from tests.support.processes import wait_until

pytestmark = pytest.mark.skipif(
    not str(celery_app.conf.broker_url).startswith("amqp://"),
    reason="RabbitMQ's queues (the defaults suite's broker is the SQLite file)",
)

LIMIT = 2


@pytest.fixture
def limited() -> Iterator[tuple[Any, ConfirmedPublisher]]:
    """A send queue of its own with a delivery limit of 2, and a publisher for it."""
    name = f"relay.limit-{uuid.uuid4().hex[:8]}"
    with override_settings(
        RELAY={**settings.RELAY, "CELERY_QUEUE": name, "CELERY_DELIVERY_LIMIT": LIMIT}
    ):
        env = conf.current()
        publisher = ConfirmedPublisher(
            str(celery_app.conf.broker_url),
            queue=broker.send_queue(env),
            declare=[broker.dead_letter_queue(env)],
        )
        yield env, publisher
        publisher.close()
        with Connection(str(celery_app.conf.broker_url)) as connection:
            channel = connection.default_channel
            channel.queue_delete(name)
            channel.queue_delete(broker.dead_letter_name(name))


def take(env: Any, connection: Connection) -> Any:
    """The next message of the queue, taken and not acknowledged."""
    return connection.SimpleQueue(broker.send_queue(env)).get(timeout=10)


def dead_letters_waiting(env: Any) -> int:
    with Connection(str(celery_app.conf.broker_url)) as connection:
        dead = connection.default_channel.queue_declare(
            broker.dead_letter_name(env.celery_queue), passive=True
        )
        return int(dead.message_count)


def registration_for(component: Any) -> Registration:
    return Registration.objects.create(
        app=component.app,
        component=component,
        service=Service.FCM,
        device_hash=uuid.uuid4().hex + "00000000",
        account_domain="localhost",
        token=f"poison-{uuid.uuid4().hex}",
        node=f"node-{uuid.uuid4().hex}",
        secret="secret",
    )


def test_a_taken_send_comes_back_when_its_consumer_is_gone(limited):
    env, publisher = limited
    publisher.publish(queue.SEND_PUSH, [{"push_id": "p1"}])
    first = Connection(str(celery_app.conf.broker_url))
    message = take(env, first)
    assert message.decode()[0] == [{"push_id": "p1"}]
    assert not message.delivery_info["redelivered"]
    first.close()  # gone with the message unacknowledged (as a killed worker's socket closes)
    with Connection(str(celery_app.conf.broker_url)) as second:
        again = take(env, second)
        assert again.decode()[0] == [{"push_id": "p1"}]
        assert again.delivery_info["redelivered"]
        again.ack()


@pytest.mark.django_db(transaction=True)
def test_a_send_past_the_delivery_limit_becomes_one_of_our_dead_letters(limited, component):
    env, publisher = limited
    registration = registration_for(component)
    push_id = str(uuid.uuid4())
    job = queue.SendJob(
        push_id=push_id,
        registration_id=registration.pk,
        publishing_domain="localhost",
        important=True,
        received="2026-01-01T00:00:00+00:00",
    )
    publisher.publish(queue.SEND_PUSH, [job.to_message()])
    # Each delivery kills its consumer (as a poison message kills its worker).
    with Connection(str(celery_app.conf.broker_url)) as connection:
        simple = connection.SimpleQueue(broker.send_queue(env))
        for _ in range(LIMIT + 1):
            simple.get(timeout=10).requeue()
        with pytest.raises(simple.Empty):
            simple.get(timeout=2)  # past the limit: gone from the send queue
        simple.close()
    # ... and kept in the dead-letter queue (RabbitMQ moves it with confirms, a moment later).
    wait_until(lambda: dead_letters_waiting(env) == 1, timeout=15)

    assert tasks.collect_broker_dead_letters() == 1
    letter = DeadLetter.objects.get(push_id=push_id)
    assert letter.reason == broker_dead_letters.REASON
    assert letter.registration_id == registration.pk and letter.replayed is None
    assert letter.job["push_id"] == push_id  # replayable with the same push id
    assert broker_dead_letters.collect() == 0  # acknowledged once recorded


@pytest.mark.django_db(transaction=True)
def test_a_dead_lettered_message_that_is_not_a_send_stays_for_an_operator(limited):
    env, _publisher = limited
    with Connection(str(celery_app.conf.broker_url)) as connection:
        dead_queue = broker.dead_letter_queue(env)
        connection.Producer().publish(
            {"not": "a task"},
            exchange=dead_queue.exchange,
            routing_key=dead_queue.routing_key,
            headers={"task": "someone.elses"},
            declare=[dead_queue],
        )
    assert broker_dead_letters.collect() == 0
    assert dead_letters_waiting(env) == 1
