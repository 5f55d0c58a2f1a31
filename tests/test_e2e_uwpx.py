"""Windows clients end to end: the JSON API, a real XMPP server's publish, our gateway and
worker processes, and our WNS client talking to the fake WNS.

The device registers its channel URI and accounts over the API, enables push on its own server
with the node, secret and push_bare_jid it got back, goes offline, and another user writes to
it: the fake WNS must receive the raw notification of docs/protocols.md 3.3 for that account.
"""

from __future__ import annotations

import json
import uuid

import pytest

from relay.models import App, Component, ComponentLink, Delivery, Registration, Tenant
from relay.windows import services as uwpx
from tests.fakes.wns import FakeWns
from tests.support.processes import start_gateway, start_worker
from tests.support.provider_fakes import configure_wns
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

DEVICE_ID = "5486bd868050a620141f4e81c9f1d2c67ab0de27e5e26d218ca41c9394ee806b"
CHANNEL_ID = "uwpx-device"


@pytest.fixture
def fake_wns():
    with FakeWns() as fake:
        yield fake


@pytest.fixture(autouse=True)
def own_rate_limit_counters(settings):
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "LOCATION": f"e2e-{uuid.uuid4()}",
        }
    }


@pytest.fixture
def windows_relay(fake_wns):
    """Our service for a Windows app on one real XMPP server: gateway and worker running."""
    started = []

    def start(server):
        component_jid, secret = server.components[0]
        tenant = Tenant.objects.create(name="uwpx")
        app = App.objects.create(
            tenant=tenant,
            name="uwpx",
        )
        configure_wns(app, fake_wns)
        component = Component.objects.create(
            tenant=tenant,
            app=app,
            jid=component_jid,
            secret=secret,
            host="127.0.0.1",
            port=server.component_port,
        )
        gateway, worker = start_gateway(), start_worker()
        started.extend([gateway, worker])
        wait_until(
            lambda: ComponentLink.objects.filter(component=component, state="up").exists(),
            timeout=30,
        )
        return app, component

    yield start
    for process in started:
        assert process.stop() == 0, process.log_text()[-3000:]


def api(client, app, message):
    response = client.post(
        f"/api/v1/apps/{app.public_key}/uwpx",
        data=json.dumps({"version": 1, "device_id": DEVICE_ID, **message}),
        content_type="application/json",
    )
    assert response.status_code == 200, response.content
    return response.json()


@pytest.mark.parametrize(
    ("kind", "named_by"),
    [("prosody", "bare_jid"), ("prosody", "account_id"), ("ejabberd", "bare_jid")],
)
def test_a_message_to_an_offline_windows_user_reaches_wns(
    request, kind, named_by, client, fake_wns, windows_relay, xmpp_client_factory
):
    server = request.getfixturevalue(kind)
    app, component = windows_relay(server)
    desktop = xmpp_client_factory(server, "desktop")
    friend = xmpp_client_factory(server, "friend")
    account_id = uwpx.account_id(device_id=DEVICE_ID, bare_jid=desktop.bare_jid)

    channel_uri = fake_wns.channel_uri(CHANNEL_ID)
    api(client, app, {"action": "set_channel_uri", "channel_uri": channel_uri})
    # The documented protocol names the account by JID; the shipped client by its hash.
    entry = {"bare_jid": desktop.bare_jid} if named_by == "bare_jid" else {"account_id": account_id}
    answer = api(client, app, {"action": "set_push_accounts", "accounts": [entry]})
    [account] = answer["accounts"]
    assert account["account_id"] == account_id
    assert answer["push_bare_jid"] == component.jid

    reply = desktop.enable_push(answer["push_bare_jid"], account["node"], account["secret"])
    assert reply.get("type") == "result", reply
    desktop.disconnect()
    friend.send_message(desktop.bare_jid, "are you at your desk?")

    [push] = fake_wns.wait_for_requests(1, timeout=30)
    assert push.channel_id == CHANNEL_ID and push.status == 200
    assert push.headers["x-wns-type"] == "wns/raw"
    assert push.headers["content-type"] == "application/octet-stream"
    body = push.json()
    assert body == {
        "version": 2,
        "action": "push",
        "account_id": account_id,
        "message_count": body["message_count"],
        "pending_subscription_count": body["pending_subscription_count"],
    }
    assert b"desk" not in push.body and desktop.bare_jid.encode() not in push.body

    delivery = wait_until(lambda: Delivery.objects.filter(outcome="delivered").first())
    assert delivery.provider == "wns"
    registration = Registration.objects.get()
    assert registration.account_domain == server.domain  # bound at the first publish, if by id

    # The test push takes the same path: queue, worker, WNS client, channel.
    assert api(client, app, {"action": "request_test_push"}) == {
        "version": 1,
        "action": "response",
        "status": 1,
    }
    test_push = fake_wns.wait_for_requests(2, timeout=30)[1]
    assert test_push.channel_id == CHANNEL_ID
    assert test_push.json()["account_id"] == account_id
