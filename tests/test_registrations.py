"""Registering devices: nodes and secrets are stable, only the token moves; new registrations
are rate-limited and capped; registrations no publish ever reached are removed."""

import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from relay import tasks
from relay.identifiers import account_hash
from relay.models import (
    App,
    Component,
    DeadLetter,
    Delivery,
    Registration,
    Service,
    Tenant,
)
from relay.services import throttling
from relay.services.registrations import (
    RegistrationRefused,
    UnknownRegistration,
    forget_counts,
    register_device,
    remove_unused_registrations,
    unregister_device,
)
from relay.windows.models import WnsAccount, WnsDevice

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


# --- limits on new registrations (a flood of register commands made 1,903 rows, unbounded)


def relay_settings(**changes: object) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, **changes})


@pytest.fixture
def fresh_limits(tmp_path):
    """A private throttling store and no cached counts."""
    with relay_settings(STATE_URL=f"sqlite:///{tmp_path / 'state.sqlite3'}"):
        throttling.reset()
        forget_counts()
        yield
        forget_counts()


def register_account(component, user, domain="jabber.de", device_id="dev", token="tok"):
    return register_device(
        component=component,
        service=Service.FCM,
        bare_jid=f"{user}@{domain}",
        device_id=device_id,
        token=token,
    )


def test_new_registrations_of_a_domain_are_rate_limited_others_are_not(component, fresh_limits):
    with relay_settings(REGISTRATION_RATE_PER_DOMAIN=(3, 3600)):
        for number in range(3):
            register_account(component, f"user{number}")
        with pytest.raises(RegistrationRefused) as refused:
            register_account(component, "flood")
        assert "too many new registrations from this domain" in refused.value.text
        assert refused.value.retry_after > 1000  # one registration per 1200 s after the burst
        register_account(component, "someone", domain="other.example")
    assert Registration.objects.filter(account_domain="jabber.de").count() == 3


def test_new_registrations_of_a_tenant_are_rate_limited(component, fresh_limits):
    with relay_settings(REGISTRATION_RATE_PER_TENANT=(2, 3600)):
        register_account(component, "a", domain="one.example")
        register_account(component, "b", domain="two.example")
        with pytest.raises(RegistrationRefused) as refused:
            register_account(component, "c", domain="three.example")
    assert "for this push service" in refused.value.text
    # Another tenant has its own bucket.
    tenant = Tenant.objects.create(name="other")
    app = App.objects.create(tenant=tenant, name="app")
    other = Component.objects.create(tenant=tenant, app=app, jid="push.other", secret="s")
    with relay_settings(REGISTRATION_RATE_PER_TENANT=(2, 3600)):
        register_account(other, "c", domain="three.example")


def test_caps_refuse_new_registrations_with_a_clear_text(component, fresh_limits):
    with relay_settings(REGISTRATION_CAP_PER_DOMAIN=2, REGISTRATION_CAP_PER_TENANT=3):
        register_account(component, "a")
        register_account(component, "b")
        with pytest.raises(RegistrationRefused) as domain_full:
            register_account(component, "c")
        assert "at most 2 registrations for one domain" in domain_full.value.text
        register_account(component, "d", domain="other.example")
        with pytest.raises(RegistrationRefused) as tenant_full:
            register_account(component, "e", domain="third.example")
        assert "at most 3 registrations" in tenant_full.value.text
    assert Registration.objects.count() == 3


def test_registering_again_is_never_refused_by_a_limit(component, fresh_limits):
    first = register_account(component, "a", token="tok-1")
    room = register_device(
        component=component,
        service=Service.FCM,
        bare_jid="a@jabber.de",
        device_id="dev",
        token="tok-1",
        room_jid="room@conference.jabber.de",
    )
    with relay_settings(
        REGISTRATION_RATE_PER_DOMAIN=(1, 3600),
        REGISTRATION_RATE_PER_TENANT=(1, 3600),
        REGISTRATION_CAP_PER_DOMAIN=2,
        REGISTRATION_CAP_PER_TENANT=3,
    ):
        throttling.reset()
        register_account(component, "x", domain="empty.example")  # the last one allowed
        with pytest.raises(RegistrationRefused):  # the limits are in force
            register_account(component, "y", domain="empty.example")
        for number in range(5):
            again = register_account(component, "a", token=f"tok-{number + 2}")
            assert (again.node, again.secret) == (first.node, first.secret)
            again_room = register_device(
                component=component,
                service=Service.FCM,
                bare_jid="a@jabber.de",
                device_id="dev",
                token=f"tok-{number + 2}",
                room_jid="room@conference.jabber.de",
            )
            assert again_room.node == room.node
    assert Registration.objects.get(node=first.node).token == "tok-6"


def test_limits_of_zero_are_off(component, fresh_limits):
    with relay_settings(
        REGISTRATION_RATE_PER_DOMAIN=(0, 3600),
        REGISTRATION_RATE_PER_TENANT=(0, 3600),
        REGISTRATION_CAP_PER_DOMAIN=0,
        REGISTRATION_CAP_PER_TENANT=0,
    ):
        for number in range(20):
            register_account(component, f"user{number}")
    assert Registration.objects.count() == 20


# --- removing registrations no publish ever reached


def test_unused_registrations_are_removed_used_and_recent_ones_kept(component, fresh_limits):
    now = timezone.now()
    old = now - timedelta(days=40)

    def registration(user: str, **fields: object) -> Registration:
        answer = register_account(component, user)
        Registration.objects.filter(node=answer.node).update(updated=old, **fields)
        return Registration.objects.get(node=answer.node)

    unused = registration("unused")
    pushed = registration("pushed", last_push=old)
    with_delivery = registration("delivery")
    Delivery.objects.create(
        tenant=component.tenant,
        app=component.app,
        registration=with_delivery,
        provider="fcm",
        publishing_domain="jabber.de",
        priority="high",
        received=old,
        queued=old,
        outcome="retry_later",
    )
    with_dead_letter = registration("dead-letter")
    DeadLetter.objects.create(
        tenant=component.tenant,
        app=component.app,
        registration=with_dead_letter,
        provider="fcm",
        reason="provider_down",
        attempts=8,
        job={},
        push_id=uuid.uuid4(),
    )
    recent = register_account(component, "recent")  # registered now
    windows = registration("windows")
    WnsAccount.objects.create(
        registration=windows,
        device=WnsDevice.objects.create(
            app=component.app, device_id_hash="h" * 64, channel_uri="https://x.notify.windows.com/"
        ),
    )
    with relay_settings(REGISTRATION_UNUSED_DAYS=30.0):
        assert remove_unused_registrations(now=now) == 1
        assert remove_unused_registrations(now=now) == 0
    remaining = set(Registration.objects.values_list("node", flat=True))
    assert unused.node not in remaining
    assert {pushed.node, with_delivery.node, with_dead_letter.node, recent.node} <= remaining
    assert windows.node in remaining  # the Windows API's devices have their own rule


def test_removal_of_unused_registrations_can_be_turned_off(component, fresh_limits):
    answer = register_account(component, "unused")
    Registration.objects.filter(node=answer.node).update(
        updated=timezone.now() - timedelta(days=400)
    )
    with relay_settings(REGISTRATION_UNUSED_DAYS=0):
        assert remove_unused_registrations() == 0
    assert Registration.objects.filter(node=answer.node).exists()


def test_the_beat_task_removes_unused_registrations(component, fresh_limits):
    answer = register_account(component, "unused")
    Registration.objects.filter(node=answer.node).update(
        updated=timezone.now() - timedelta(days=31)
    )
    schedule = settings.CELERY_BEAT_SCHEDULE["remove-unused-registrations"]
    assert schedule["task"] == tasks.remove_unused_registrations.name
    assert tasks.remove_unused_registrations.apply().get() == 1
    assert not Registration.objects.filter(node=answer.node).exists()
