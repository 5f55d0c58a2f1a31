"""Registering devices: nodes and secrets are stable, only the token moves."""

import pytest

from relay.identifiers import account_hash
from relay.models import Registration, Service
from relay.services.registrations import UnknownRegistration, register_device, unregister_device

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]


def register(component, token="tok-1", device_id="92afd7a91cdba9a0", room=""):
    return register_device(
        component=component,
        service=Service.FCM,
        bare_jid="xiaomia1@jabber.de",
        device_id=device_id,
        token=token,
        room_jid=room,
    )


def test_registration_stores_domain_and_hash_never_the_jid(component):
    answer = register(component)
    registration = Registration.objects.get()
    assert answer.component_jid == "push.localhost"
    assert (answer.node, answer.secret) == (registration.node, registration.secret)
    assert registration.device_hash == "ec164939a8485ee6b7f7871071a11c7bb18aead5"
    assert registration.account_domain == "jabber.de"
    stored = " ".join(str(value) for value in Registration.objects.values().get().values())
    assert "xiaomia1" not in stored


def test_registering_again_keeps_node_and_secret_and_updates_the_token(component):
    first = register(component, token="tok-1")
    Registration.objects.update(dead_since="2026-01-01T00:00:00Z")
    second = register(component, token="tok-2")
    assert (second.node, second.secret) == (first.node, first.secret)
    registration = Registration.objects.get()
    assert registration.token == "tok-2"
    assert registration.dead_since is None


def test_a_room_gets_its_own_registration(component):
    account = register(component)
    room = register(component, room="room@conference.jabber.de")
    assert room.node != account.node
    assert Registration.objects.get(node=room.node).room_hash == account_hash(
        "room@conference.jabber.de", "92afd7a91cdba9a0"
    )


def test_unregister_removes_and_then_reports_nothing_to_remove(component):
    register(component)
    unregister_device(
        component=component,
        service=Service.FCM,
        bare_jid="xiaomia1@jabber.de",
        device_id="92afd7a91cdba9a0",
    )
    assert not Registration.objects.exists()
    with pytest.raises(UnknownRegistration):
        unregister_device(
            component=component,
            service=Service.FCM,
            bare_jid="xiaomia1@jabber.de",
            device_id="92afd7a91cdba9a0",
        )
