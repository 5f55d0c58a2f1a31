"""The relay end to end, with real Prosody and ejabberd, our gateway and worker processes,
and the real firebase-admin client talking to a fake FCM.

A test user registers with the component by ad-hoc command (as Conversations does), enables
push on its own server, goes away, and another user writes to it.
"""

from __future__ import annotations

import contextlib
import json
from urllib.parse import urlsplit

import pytest
from django.conf import settings

from relay.identifiers import account_hash
from relay.models import App, Component, ComponentLink, Delivery, Registration, Tenant
from relay.report_models import PublishTally
from tests.fakes.fcm import FakeFcm
from tests.support import broker
from tests.support.processes import start_gateway, start_worker, test_database_url
from tests.support.provider_fakes import configure
from tests.support.proxy import TcpProxy
from tests.support.waiting import holds_for, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

DEVICE_ID = "92afd7a91cdba9a0"


@pytest.fixture
def fake_fcm():
    with FakeFcm() as fake:
        yield fake


class Relay:
    """Our service attached to one real XMPP server."""

    def __init__(self, server, fake_fcm, gateway_env=None, *, with_worker=True):
        component_jid, secret = server.components[0]
        tenant = Tenant.objects.create(name="acme")
        self.app = App.objects.create(
            tenant=tenant,
            name="conversations",
        )
        configure(
            self.app,
            "fcm",
            service_account=json.dumps(fake_fcm.service_account()),
            endpoint=fake_fcm.url,
        )
        self.component = Component.objects.create(
            tenant=tenant,
            app=self.app,
            jid=component_jid,
            secret=secret,
            host="127.0.0.1",
            port=server.component_port,
        )
        self.server = server
        self.fake = fake_fcm
        self.gateway = start_gateway(**(gateway_env or {}))
        self.worker = start_worker() if with_worker else None
        wait_until(
            lambda: ComponentLink.objects.filter(component=self.component, state="up").exists(),
            what=lambda: f"the link is up\n{self.gateway.log_tail()}",
        )

    def stop(self):
        codes = (self.gateway.stop(), self.worker.stop() if self.worker else 0)
        assert codes[0] == 0, self.gateway.log_text()[-3000:]

    def register(self, client, token, *, device_id=DEVICE_ID, node="register-push-fcm"):
        reply = client.execute_command(
            self.component.jid, node, {"token": token, "device-id": device_id}
        )
        command = reply.find("{http://jabber.org/protocol/commands}command")
        assert command is not None and command.get("status") == "completed", reply
        values = {
            field.get("var"): field.findtext("{jabber:x:data}value")
            for field in command.iter("{jabber:x:data}field")
        }
        assert values["jid"] == self.component.jid
        return values["node"], values["secret"]

    def verdicts(self, verdict):
        return self.gateway.log_text().count(f'"verdict": "{verdict}"')


@pytest.fixture
def relay_on(fake_fcm):
    relays = []

    def make(server, *, with_worker=True, **gateway_env):
        relay = Relay(server, fake_fcm, gateway_env, with_worker=with_worker)
        relays.append(relay)
        return relay

    yield make
    for relay in relays:
        relay.stop()


def enable(client, relay, node, secret):
    reply = client.enable_push(relay.component.jid, node, secret)
    assert reply.get("type") == "result", reply


@pytest.mark.parametrize("away", ["hibernated", "offline"])
def test_a_message_to_an_absent_user_wakes_the_phone_once(
    xmpp_server, relay_on, xmpp_client_factory, away
):
    relay = relay_on(xmpp_server)
    phone = xmpp_client_factory(xmpp_server, "phone")
    friend = xmpp_client_factory(xmpp_server, "friend")
    token = f"fcm-token-{away}-{xmpp_server.kind}"
    node, secret = relay.register(phone, token)
    enable(phone, relay, node, secret)
    if away == "hibernated":
        phone.abort()
    else:
        phone.disconnect()
    friend.send_message(phone.bare_jid, "hello, are you there?")

    [request] = relay.fake.wait_for_requests(1, timeout=30)
    holds_for(
        lambda: len(relay.fake.requests_for(token)) == 1, 2, "nothing more follows one message"
    )
    message = request.message
    assert message["token"] == token
    assert message["data"] == {"account": account_hash(phone.bare_jid, DEVICE_ID)}
    assert message["android"]["priority"] == "high"
    assert "hello" not in repr(message)

    delivery = wait_until(lambda: Delivery.objects.filter(outcome="delivered").first())
    assert delivery.provider == "fcm" and delivery.priority == "high"
    assert delivery.publishing_domain == xmpp_server.domain
    registration = Registration.objects.get(node=node)
    assert registration.account_domain == xmpp_server.domain
    assert phone.bare_jid not in repr(Registration.objects.values().get(node=node))


def test_an_everyday_push_goes_out_from_the_gateway_without_a_worker(
    xmpp_server, relay_on, xmpp_client_factory, send_queue
):
    """The gateway sends an everyday push itself (relay/services/direct_sends.py) and answers
    once FCM took it: no broker message, no worker."""
    relay = relay_on(xmpp_server, with_worker=False)
    phone = xmpp_client_factory(xmpp_server, "phone")
    friend = xmpp_client_factory(xmpp_server, "friend")
    token = f"fcm-token-direct-{xmpp_server.kind}"
    node, secret = relay.register(phone, token)
    enable(phone, relay, node, secret)
    phone.disconnect()
    friend.send_message(phone.bare_jid, "hello, are you there?")

    [request] = relay.fake.wait_for_requests(1, timeout=30)
    assert request.message["token"] == token
    delivery = wait_until(lambda: Delivery.objects.filter(outcome="delivered").first())
    assert delivery.publishing_domain == xmpp_server.domain
    wait_until(lambda: _accepted_tallies() == 1, what="the publish answered result")
    assert broker.depth() == 0


def test_with_direct_sends_off_every_push_waits_for_a_worker(
    xmpp_server, relay_on, xmpp_client_factory, send_queue
):
    relay = relay_on(xmpp_server, with_worker=False, RELAY_DIRECT_SEND_SHARE="0")
    phone = xmpp_client_factory(xmpp_server, "phone")
    friend = xmpp_client_factory(xmpp_server, "friend")
    node, secret = relay.register(phone, f"fcm-token-queued-{xmpp_server.kind}")
    enable(phone, relay, node, secret)
    phone.disconnect()
    friend.send_message(phone.bare_jid, "hello, are you there?")

    wait_until(lambda: broker.depth() == 1, what="the push queued for a worker")
    assert relay.fake.requests == []  # no worker runs: nothing else could have sent it
    relay.worker = start_worker()
    relay.fake.wait_for_requests(1, timeout=30)
    wait_until(lambda: Delivery.objects.filter(outcome="delivered").exists())


def test_the_gateway_writes_its_publish_tallies_on_its_timer_and_when_it_stops(
    prosody, relay_on, xmpp_client_factory
):
    """The tallies are summed in the gateway (RELAY_TALLY_FLUSH_SECONDS): the first publish
    is written at once, the next ones by the timer, and what is left when it stops."""
    # 15 s: the second publish must reach FCM before the timer writes it, on a busy machine too.
    relay = relay_on(prosody, RELAY_TALLY_FLUSH_SECONDS="15", RELAY_COALESCE_SECONDS="0")
    phone = xmpp_client_factory(prosody, "phone")
    friend = xmpp_client_factory(prosody, "friend")
    node, secret = relay.register(phone, "fcm-token-tallies")
    enable(phone, relay, node, secret)
    phone.disconnect()

    def accepted() -> int:
        rows = PublishTally.objects.filter(verdict="accepted", tenant=relay.component.tenant)
        return sum(row.count for row in rows)

    friend.send_message(phone.bare_jid, "one")
    wait_until(lambda: accepted() == 1)
    friend.send_message(phone.bare_jid, "two")
    relay.fake.wait_for_requests(2, timeout=30)
    assert accepted() == 1  # summed, not written yet
    wait_until(lambda: accepted() == 2)  # the timer
    friend.send_message(phone.bare_jid, "three")
    relay.fake.wait_for_requests(3, timeout=30)
    relay.stop()
    assert accepted() == 3  # written on the way out


def test_a_wrong_secret_sends_nothing(xmpp_server, relay_on, xmpp_client_factory):
    relay = relay_on(xmpp_server)
    phone = xmpp_client_factory(xmpp_server, "phone")
    friend = xmpp_client_factory(xmpp_server, "friend")
    node, _secret = relay.register(phone, "fcm-token-wrong-secret")
    enable(phone, relay, node, "not-the-secret")
    phone.disconnect()
    friend.send_message(phone.bare_jid, "hello")
    wait_until(lambda: relay.verdicts("forbidden") >= 1)
    assert relay.fake.send_count == 0
    assert not Delivery.objects.exists()


def test_an_unknown_node_is_item_not_found(ejabberd, relay_on, xmpp_client_factory):
    relay = relay_on(ejabberd)
    phone = xmpp_client_factory(ejabberd, "phone")
    friend = xmpp_client_factory(ejabberd, "friend")
    enable(phone, relay, "no-such-node", "whatever")
    phone.disconnect()
    friend.send_message(phone.bare_jid, "one")
    wait_until(lambda: relay.verdicts("unknown-node") >= 1)
    friend.send_message(phone.bare_jid, "two")
    # ejabberd dropped the registration after our item-not-found: no second publish comes.
    holds_for(
        lambda: relay.verdicts("unknown-node") == 1 and relay.fake.send_count == 0,
        2,
        "no second publish",
    )


def test_a_dead_token_ends_the_registration_on_the_users_server(
    ejabberd, relay_on, xmpp_client_factory
):
    relay = relay_on(ejabberd)
    phone = xmpp_client_factory(ejabberd, "phone")
    friend = xmpp_client_factory(ejabberd, "friend")
    token = "fcm-token-uninstalled"
    relay.fake.respond(token, status=404, error_code="UNREGISTERED")
    node, secret = relay.register(phone, token)
    enable(phone, relay, node, secret)
    phone.disconnect()

    friend.send_message(phone.bare_jid, "one")
    relay.fake.wait_for_requests(1, timeout=30)
    wait_until(lambda: Registration.objects.get(node=node).dead_since is not None)
    assert Delivery.objects.get().outcome == "dead_token"

    friend.send_message(phone.bare_jid, "two")
    wait_until(lambda: relay.verdicts("unknown-node") >= 1)
    friend.send_message(phone.bare_jid, "three")
    holds_for(
        lambda: relay.verdicts("unknown-node") == 1 and relay.fake.send_count == 1,
        2,
        "ejabberd stopped publishing to it",
    )


def test_a_dead_token_makes_prosody_disable_push(
    xmpp_server_factory, relay_on, xmpp_client_factory
):
    prosody = xmpp_server_factory("prosody", push_max_errors=1)
    relay = relay_on(prosody)
    phone = xmpp_client_factory(prosody, "phone")
    friend = xmpp_client_factory(prosody, "friend")
    token = "fcm-token-gone"
    relay.fake.respond(token, status=404, error_code="UNREGISTERED")
    node, secret = relay.register(phone, token)
    enable(phone, relay, node, secret)
    phone.disconnect()
    friend.send_message(phone.bare_jid, "one")
    wait_until(lambda: Registration.objects.get(node=node).dead_since is not None, timeout=30)
    friend.send_message(phone.bare_jid, "two")
    wait_until(lambda: relay.verdicts("unknown-node") >= 1)
    prosody.wait_for_log("Disabling push notifications", timeout=10)


def _through(proxy_target: tuple[str, int]) -> TcpProxy:
    return TcpProxy(*proxy_target)


@pytest.mark.parametrize("outage", ["database", "broker"])
def test_an_outage_answers_wait_and_ejabberd_keeps_the_registration(
    ejabberd, relay_on, xmpp_client_factory, outage
):
    if outage == "database":
        db = settings.DATABASES["default"]
        proxy = _through((db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432)))
        env = {"DATABASE_URL": test_database_url(host="127.0.0.1", port=proxy.port)}
    else:
        url = urlsplit(settings.CELERY_BROKER_URL)
        proxy = _through((url.hostname or "127.0.0.1", url.port or 5672))
        # Every publish a send of its own: without coalescing, none waits for beat's sweep
        # (which this test does not run) as a deferred row. Every send through the broker,
        # as a busy gateway's go: an everyday one needs no broker (the test below).
        env = {
            "CELERY_BROKER_URL": broker.through(proxy.port),
            "RELAY_COALESCE_SECONDS": "0",
            "RELAY_DIRECT_SEND_SHARE": "0",
        }
    try:
        relay = relay_on(ejabberd, **env)
        phone = xmpp_client_factory(ejabberd, "phone")
        friend = xmpp_client_factory(ejabberd, "friend")
        token = f"fcm-token-outage-{outage}"
        node, secret = relay.register(phone, token)
        enable(phone, relay, node, secret)
        phone.disconnect()

        proxy.cut()
        friend.send_message(phone.bare_jid, "during the outage")
        wait_until(lambda: relay.verdicts("unavailable") >= 1)
        proxy.restore()
        # The relay takes its connection back on its next use (a busy machine may take a
        # while): a publish that still meets the broken one is answered `wait` again, and
        # ejabberd keeps the registration through that too, so the next one gets through.

        def reached_the_provider() -> bool:
            friend.send_message(phone.bare_jid, "after the outage")
            with contextlib.suppress(TimeoutError):
                return bool(relay.fake.wait_for_requests(1, timeout=5))
            return False

        wait_until(
            reached_the_provider,
            what=lambda: f"a message after the outage reaches FCM\n{relay.gateway.log_tail()}",
        )
        assert {request.token for request in relay.fake.requests} == {token}
    finally:
        proxy.close()


def test_an_everyday_push_goes_out_while_the_broker_is_away(
    ejabberd, relay_on, xmpp_client_factory
):
    url = urlsplit(settings.CELERY_BROKER_URL)
    proxy = _through((url.hostname or "127.0.0.1", url.port or 5672))
    try:
        relay = relay_on(ejabberd, CELERY_BROKER_URL=broker.through(proxy.port))
        phone = xmpp_client_factory(ejabberd, "phone")
        friend = xmpp_client_factory(ejabberd, "friend")
        token = "fcm-token-broker-away"
        node, secret = relay.register(phone, token)
        enable(phone, relay, node, secret)
        phone.disconnect()
        proxy.cut()
        friend.send_message(phone.bare_jid, "while the broker is away")
        [request] = relay.fake.wait_for_requests(1, timeout=30)
        assert request.token == token
        wait_until(lambda: Delivery.objects.filter(outcome="delivered").exists())
        wait_until(lambda: _accepted_tallies() == 1, what="the publish answered result")
        assert relay.verdicts("unavailable") == 0
    finally:
        proxy.close()


def _accepted_tallies() -> int:
    """Publishes the gateway answered `result`, from its tallies (written every second)."""
    return sum(PublishTally.objects.filter(verdict="accepted").values_list("count", flat=True))


def test_the_link_comes_back_after_the_xmpp_server_restarts(
    xmpp_server_factory, relay_on, xmpp_client_factory
):
    prosody = xmpp_server_factory("prosody")
    relay = relay_on(prosody)
    prosody.restart()
    # The gateway notices the lost stream, reconnects with backoff, and serves again.
    wait_until(
        lambda: (
            ComponentLink.objects.filter(component=relay.component, state="up").exists()
            and relay.gateway.log_text().count('"link.up"') >= 2
        ),
        timeout=30,
    )
    phone = xmpp_client_factory(prosody, "phone")
    friend = xmpp_client_factory(prosody, "friend")
    node, secret = relay.register(phone, "fcm-token-after-restart")
    enable(phone, relay, node, secret)
    phone.disconnect()
    friend.send_message(phone.bare_jid, "after the restart")
    [request] = relay.fake.wait_for_requests(1, timeout=30)
    assert request.token == "fcm-token-after-restart"


def test_a_phone_over_the_registration_limit_is_told_to_wait_through_a_real_server(
    xmpp_server, relay_on, xmpp_client_factory
):
    """The answer to a refused register command reaches the phone as `wait` with its text
    (Conversations tries again later), and registering the same device again still works."""
    relay = relay_on(xmpp_server, RELAY_REGISTRATION_RATE_PER_DOMAIN="1/3600")
    phone = xmpp_client_factory(xmpp_server, "phone")
    node, secret = relay.register(phone, "fcm-token-first", device_id="device-a")
    refused = phone.execute_command(
        relay.component.jid, "register-push-fcm", {"token": "t", "device-id": "device-b"}
    )
    assert refused.get("type") == "error"
    error = refused.find("{jabber:client}error")
    assert error.get("type") == "wait"
    assert error.find("{urn:ietf:params:xml:ns:xmpp-stanzas}resource-constraint") is not None
    text = error.findtext("{urn:ietf:params:xml:ns:xmpp-stanzas}text")
    assert "too many new registrations from this domain" in text
    again = relay.register(phone, "fcm-token-second", device_id="device-a")
    assert again == (node, secret)
    assert Registration.objects.get(node=node).token == "fcm-token-second"
