"""A WNS channel the app may never send to is refused when a phone registers it over the
ad-hoc command, not dead-lettered at every push (relay/services/channels.py).

The test plays the user's XMPP server towards our real gateway process; the Windows API's side
of the same rule is in tests/test_api_uwpx.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from relay.models import App, Component, Registration, Service, Tenant
from tests.support.component_server import STANZAS_NS, FakeXmppServer, error_of
from tests.support.processes import start_gateway
from tests.support.provider_fakes import change_credentials

pytestmark = [pytest.mark.defaults, pytest.mark.django_db(transaction=True)]

COMPONENT = "push.localhost"
SECRET = "component-secret-0123456789"
CHANNEL = "http://127.0.0.1:8080/wns/channel?token=abc"
COMMAND = (
    "<iq type='set' from='alice@localhost/phone' to='push.localhost' id='{id}'>"
    "<command xmlns='http://jabber.org/protocol/commands' action='execute' node='{node}'>"
    "<x xmlns='jabber:x:data' type='submit'>"
    "<field var='token'><value>{token}</value></field>"
    "<field var='device-id'><value>device-1</value></field>"
    "</x></command></iq>"
)


@pytest.fixture
def link() -> Iterator[tuple[FakeXmppServer, App]]:
    server = FakeXmppServer(COMPONENT, SECRET)
    tenant = Tenant.objects.create(name="windows")
    # A bare host: it allows the default port only (80 for http on loopback).
    app = App.objects.create(tenant=tenant, name="app")
    change_credentials(app, "wns", channel_hosts="127.0.0.1")
    Component.objects.create(
        tenant=tenant, app=app, jid=COMPONENT, secret=SECRET, host="127.0.0.1", port=server.port
    )
    gateway = start_gateway()
    try:
        server.wait_connected(gateway=gateway)
        yield server, app
        assert gateway.process.returncode is None, gateway.log_text()[-3000:]
    finally:
        assert gateway.stop() == 0, gateway.log_text()[-3000:]
        server.close()


def command(server: FakeXmppServer, iq_id: str, node: str, token: str):
    return server.request(COMMAND.format(id=iq_id, node=node, token=token), iq_id)


def error_text(reply) -> str:
    text = reply.find(f".//{{{STANZAS_NS}}}text")
    return text.text if text is not None else ""


def test_an_unsendable_wns_channel_is_refused_at_registration(link):
    server, app = link
    reply = command(server, "refused", "register-push-wns", CHANNEL.replace("&", "&amp;"))
    assert error_of(reply) == ("modify", "not-acceptable")
    text = error_text(reply)
    assert "'127.0.0.1' allows port 80 only, not 8080" in text and "127.0.0.1:8080" in text
    assert "token=abc" not in text
    assert not Registration.objects.exists()

    # Other services' tokens are not channel URIs: untouched by the rule.
    assert error_of(command(server, "fcm", "register-push-fcm", "fcm-token")) is None

    # Once the operator allows the port, the same registration completes.
    change_credentials(app, "wns", channel_hosts="127.0.0.1:8080")
    reply = command(server, "allowed", "register-push-wns", CHANNEL)
    assert error_of(reply) is None
    assert Registration.objects.filter(service=Service.WNS, token=CHANNEL).count() == 1
