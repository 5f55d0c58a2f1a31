"""End to end: a real Prosody publishes, our gateway and worker processes relay, and the APNs
fake (HTTP/2, token auth) and the WNS fake receive the wake-ups.

Bob registers through the ad-hoc command his phone would use (`register-push-apns`, and Carol
`register-push-wns`), enables push on Prosody, drops his connection (a hibernated session),
and Alice writes to him: Prosody publishes to the component, the relay sends.
"""

from __future__ import annotations

import hashlib
import uuid

import pytest

from relay.identifiers import account_hash
from relay.models import Component, ComponentLink, Delivery, LinkState, Service
from relay.providers.base import Outcome
from relay.services import throttling
from tests.fakes.wns import FakeWns
from tests.support.processes import start_gateway, start_worker
from tests.support.provider_fakes import configure_apns, configure_wns, start_apns
from tests.support.waiting import wait_until
from tests.support.xmpp_client import form_values

pytestmark = [pytest.mark.peers, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def fakes():
    apns, key_pem = start_apns()
    wns = FakeWns().start()
    yield apns, key_pem, wns
    apns.stop()
    wns.stop()


def register(client, component_jid: str, command: str, token: str, device_id: str):
    reply = client.execute_command(component_jid, command, {"token": token, "device-id": device_id})
    assert reply.get("type") == "result", reply
    values = form_values(reply)
    return values["node"][0], values["secret"][0]


def test_prosody_publish_reaches_apns_and_wns(prosody, xmpp_client_factory, component, fakes):
    apns, key_pem, wns = fakes
    component_jid, component_secret = prosody.components[0]
    Component.objects.filter(pk=component.pk).update(
        jid=component_jid, secret=component_secret, host=prosody.host, port=prosody.component_port
    )
    app = component.app
    configure_apns(app, apns, key_pem)
    configure_wns(app, wns)
    app.save()
    throttling.reset()

    gateway, worker = start_gateway(), start_worker()
    try:
        wait_until(
            lambda: ComponentLink.objects.filter(component=component, state=LinkState.UP).exists(),
            timeout=30,
        )
        alice = xmpp_client_factory(prosody, "alice")
        bob = xmpp_client_factory(prosody, "bob")
        carol = xmpp_client_factory(prosody, "carol")
        apns_token = uuid.uuid4().hex * 2  # 64 hex digits, like an iPhone's
        channel = f"e2e{uuid.uuid4().hex[:8]}"
        node_b, secret_b = register(bob, component_jid, "register-push-apns", apns_token, "iphone")
        node_c, secret_c = register(
            carol, component_jid, "register-push-wns", wns.channel_uri(channel), "surface"
        )
        assert bob.enable_push(component_jid, node_b, secret=secret_b).get("type") == "result"
        assert carol.enable_push(component_jid, node_c, secret=secret_c).get("type") == "result"
        bob.abort()
        carol.abort()
        alice.send_message(bob.bare_jid, "for bob")
        alice.send_message(carol.bare_jid, "for carol")

        [to_apns] = apns.wait_for_requests(1, timeout=30)
        [to_wns] = wns.wait_for_requests(1, timeout=30)
        wait_until(lambda: Delivery.objects.filter(outcome=Outcome.DELIVERED).count() >= 2)
    finally:
        gateway.stop()
        worker.stop()

    # APNs: bob's phone, an alert (Prosody's summary has a body), the account hash inside.
    assert to_apns.token == apns_token and to_apns.status == 200
    assert (to_apns.push_type, to_apns.priority) == ("alert", "10")
    assert to_apns.headers["apns-topic"] == apns.topic
    assert to_apns.body["account"] == account_hash(bob.bare_jid, "iphone")
    assert "for bob" not in str(to_apns.body) and "alice" not in str(to_apns.body)
    apns_record = Delivery.objects.get(push_id=to_apns.headers["apns-id"])
    assert (apns_record.provider, apns_record.outcome) == (Service.APNS, Outcome.DELIVERED)

    # WNS: carol's channel, a raw wake-up at high priority with her account hash.
    assert to_wns.channel_id == channel and to_wns.status == 200
    assert to_wns.headers["x-wns-type"] == "wns/raw"
    assert to_wns.headers["x-wns-priority"] == "1"
    body = to_wns.json()
    assert body["account_id"] == account_hash(carol.bare_jid, "surface")
    assert body["account_id"] == hashlib.sha1(f"{carol.bare_jid}\0surface".encode()).hexdigest()
    assert "for carol" not in str(body)
    wns_record = Delivery.objects.get(provider=Service.WNS)
    assert wns_record.outcome == Outcome.DELIVERED and wns_record.publishing_domain == "localhost"
