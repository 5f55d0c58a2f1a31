"""Accepting publishes: the verdict decides whether users keep their push."""

import pytest
from django.utils import timezone

from relay.models import Service
from relay.services.publishing import Publish, Verdict, accept_publish
from relay.services.registrations import register_device

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]


@pytest.fixture
def registration(component):
    return register_device(
        component=component,
        service=Service.FCM,
        bare_jid="alice@localhost",
        device_id="dev-1",
        token="tok-1",
    )


def publish(component, registration, **changes):
    values = {
        "component_id": component.pk,
        "publishing_domain": "localhost",
        "node": registration.node,
        "secret": registration.secret,
        "important": True,
        "message_count": 1,
    }
    values.update(changes)
    return accept_publish(Publish(**values))


def test_accepted_publish_is_queued_without_token_or_jid(component, registration, send_queue):
    assert publish(component, registration) is Verdict.ACCEPTED
    [job] = send_queue.queued_jobs()
    assert job["important"] is True
    assert job["publishing_domain"] == "localhost"
    assert job["queued"] and job["received"]
    assert "tok-1" not in repr(job) and "alice" not in repr(job)


def test_wrong_secret_is_forbidden_and_queues_nothing(component, registration, send_queue):
    assert publish(component, registration, secret="wrong") is Verdict.FORBIDDEN
    assert send_queue.queued_jobs() == []


def test_unknown_node_and_other_domain_are_unknown(component, registration, send_queue):
    assert publish(component, registration, node="nope") is Verdict.UNKNOWN_NODE
    assert publish(component, registration, publishing_domain="evil.org") is Verdict.UNKNOWN_NODE
    assert send_queue.queued_jobs() == []


def test_dead_registration_is_unknown(component, registration, send_queue):
    from relay.models import Registration

    Registration.objects.update(dead_since=timezone.now())
    assert publish(component, registration) is Verdict.UNKNOWN_NODE
