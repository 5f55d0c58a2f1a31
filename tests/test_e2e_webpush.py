"""End to end: a browser-style Web Push subscription registered over real Prosody and ejabberd
(`register-push-webpush`), a message to the absent user, and the fake push service decrypting
the wake-up with the subscription's private key; a gone subscription (410) ends the
registration on the user's server as a dead FCM token does."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from relay.identifiers import account_hash
from relay.models import (
    App,
    Component,
    ComponentLink,
    DeadLetter,
    Delivery,
    LinkState,
    Registration,
    Service,
    Tenant,
)
from relay.providers.base import Outcome
from relay.providers.webpush import new_private_key, public_key
from relay.services import usage
from tests.fakes.webpush import FakePushService, FakeReply
from tests.support.processes import start_gateway, start_worker
from tests.support.provider_fakes import configure
from tests.support.waiting import holds_for, wait_until
from tests.support.xmpp_client import form_values

pytestmark = [pytest.mark.peers, pytest.mark.django_db(transaction=True)]

DEVICE_ID = "browser-profile-1"


class Relay:
    """Our gateway and worker attached to one real XMPP server, for a Web Push app."""

    def __init__(self, server, fake: FakePushService) -> None:
        component_jid, secret = server.components[0]
        tenant = Tenant.objects.create(name="web")
        self.private_key = new_private_key()
        self.app = App.objects.create(tenant=tenant, name="browser")
        configure(
            self.app,
            "webpush",
            private_key=self.private_key,
            subject="mailto:ops@example.org",
            endpoint_hosts=fake.host_pattern,
        )
        self.component = Component.objects.create(
            tenant=tenant,
            app=self.app,
            jid=component_jid,
            secret=secret,
            host="127.0.0.1",
            port=server.component_port,
        )
        self.fake = fake
        self.gateway = start_gateway()
        self.worker = start_worker()
        wait_until(
            lambda: ComponentLink.objects.filter(
                component=self.component, state=LinkState.UP
            ).exists(),
            what=lambda: f"the link is up\n{self.gateway.log_tail()}",
        )

    def register(self, client, fields: dict[str, str]) -> tuple[str, str]:
        reply = client.execute_command(
            self.component.jid, "register-push-webpush", {**fields, "device-id": DEVICE_ID}
        )
        assert reply.get("type") == "result", reply
        values = form_values(reply)
        return values["node"][0], values["secret"][0]

    def verdicts(self, verdict: str) -> int:
        return self.gateway.log_text().count(f'"verdict": "{verdict}"')

    def stop(self) -> None:
        codes = (self.gateway.stop(), self.worker.stop())
        assert codes[0] == 0, self.gateway.log_text()[-3000:]


@pytest.fixture
def relay_on():
    relays: list[Relay] = []
    fake = FakePushService().start()

    def make(server) -> Relay:
        relay = Relay(server, fake)
        relays.append(relay)
        return relay

    yield make
    for relay in relays:
        relay.stop()
    fake.stop()


def test_a_message_to_an_absent_user_reaches_the_subscription_encrypted(
    xmpp_server, relay_on, xmpp_client_factory
):
    relay = relay_on(xmpp_server)
    phone = xmpp_client_factory(xmpp_server, "phone")
    friend = xmpp_client_factory(xmpp_server, "friend")
    subscription = relay.fake.subscribe()
    node, secret = relay.register(phone, subscription.fields())
    assert phone.enable_push(relay.component.jid, node, secret).get("type") == "result"
    phone.abort()
    friend.send_message(phone.bare_jid, "hello, are you there?")

    [message] = relay.fake.wait_for(1)
    holds_for(
        lambda: len(relay.fake.received) == 1,
        2,
        lambda: (
            f"nothing more follows one message: the service saw {relay.fake.received!r}; "
            f"publishes answered {relay.verdicts('accepted')}\n{relay.worker.log_tail()}"
        ),
    )
    assert message.subscription_id == subscription.id
    assert message.payload() == {
        "account": account_hash(phone.bare_jid, DEVICE_ID),
        "priority": "high",
    }
    assert message.headers["urgency"] == "high"
    assert message.vapid_key == public_key(relay.private_key)
    assert relay.fake.refusals == []
    delivery = wait_until(lambda: Delivery.objects.filter(outcome=Outcome.DELIVERED).first())
    assert (delivery.provider, delivery.priority) == (Service.WEBPUSH, "high")
    assert delivery.publishing_domain == xmpp_server.domain
    # Counted as the other providers are: the admin's usage by provider lists it.
    rates = {rate.provider: rate.counts for rate in usage.provider_rates(tenant_ids=None)}
    assert (rates["webpush"].received, rates["webpush"].delivered) == (1, 1)
    registration = Registration.objects.get(node=node)
    assert registration.service == Service.WEBPUSH
    assert phone.bare_jid not in repr(Registration.objects.values().get(node=node))


def test_an_endpoint_the_app_does_not_allow_is_refused_at_registration(
    prosody, relay_on, xmpp_client_factory
):
    relay = relay_on(prosody)
    phone = xmpp_client_factory(prosody, "phone")
    fields = {**relay.fake.subscribe().fields(), "endpoint": "https://10.0.0.1/push/x"}
    reply = phone.execute_command(
        relay.component.jid, "register-push-webpush", {**fields, "device-id": DEVICE_ID}
    )
    assert reply.get("type") == "error", reply
    assert "not-acceptable" in ET.tostring(reply, encoding="unicode")
    broken = {**relay.fake.subscribe().fields(), "auth": "AAAA"}
    reply = phone.execute_command(
        relay.component.jid, "register-push-webpush", {**broken, "device-id": DEVICE_ID}
    )
    assert reply.get("type") == "error", reply
    text = ET.tostring(reply, encoding="unicode")
    assert "bad-request" in text and "auth must be" in text
    assert not Registration.objects.exists()


def test_a_gone_subscription_ends_the_registration_on_the_users_server(
    ejabberd, relay_on, xmpp_client_factory
):
    relay = relay_on(ejabberd)
    phone = xmpp_client_factory(ejabberd, "phone")
    friend = xmpp_client_factory(ejabberd, "friend")
    subscription = relay.fake.subscribe()
    relay.fake.script(subscription, FakeReply(410))
    node, secret = relay.register(phone, subscription.fields())
    assert phone.enable_push(relay.component.jid, node, secret).get("type") == "result"
    phone.disconnect()

    friend.send_message(phone.bare_jid, "one")
    relay.fake.wait_for(1)
    wait_until(lambda: Registration.objects.get(node=node).dead_since is not None)
    assert Delivery.objects.get().outcome == Outcome.DEAD_TOKEN
    assert not DeadLetter.objects.exists()

    friend.send_message(phone.bare_jid, "two")
    wait_until(lambda: relay.verdicts("unknown-node") >= 1)
    friend.send_message(phone.bare_jid, "three")
    holds_for(
        lambda: relay.verdicts("unknown-node") == 1 and len(relay.fake.received) == 1,
        2,
        "ejabberd stopped publishing to it",
    )
