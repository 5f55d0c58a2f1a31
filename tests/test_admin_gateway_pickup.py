"""A component added, changed, disabled or deleted in the admin reaches the running gateway
within seconds, with a real Prosody on the other end and no restart of anything.

Prosody knows the component (its JID and secret) before the operator adds it, as when the
XMPP server's admin has pasted the configuration first.
"""

from __future__ import annotations

import hashlib
import xml.etree.ElementTree as ET

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from relay.models import App, Component, ComponentLink, Tenant
from tests.support.admin import (
    admin_settings,  # noqa: F401 -- fixture
    changeform_data,
    login_verified,
)
from tests.support.processes import start_gateway
from tests.support.waiting import wait_until
from tests.support.xmpp_client import COMPONENT_NS, STREAM_NS, RawXmppStream, StreamClosed

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("admin_settings")]

JID = "push.pickup.localhost"
SECRET = "Pickup-Secret-0123456789abcdef"


def handshake(server, secret: str = SECRET) -> str:
    """Connect to the server as the component ourselves: "ok", or the stream error's name.

    Prosody lets one connection hold a component, so "conflict" means the gateway holds it.
    """
    with RawXmppStream(server.host, server.component_port, timeout=5) as stream:
        stream.open(JID, COMPONENT_NS, version=False)
        digest = hashlib.sha1((stream.stream_id + secret).encode()).hexdigest()
        stream.send(f"<handshake>{digest}</handshake>")
        try:
            reply = stream.read_element()
        except StreamClosed:
            return "closed"
    if reply.tag == f"{{{COMPONENT_NS}}}handshake":
        return "ok"
    if reply.tag == f"{{{STREAM_NS}}}error":
        return reply[0].tag.rsplit("}", 1)[-1] if len(reply) else "stream-error"
    return ET.tostring(reply, encoding="unicode")


def link(component: Component) -> ComponentLink | None:
    return ComponentLink.objects.filter(component_id=component.pk).first()


@pytest.fixture
def operator_client() -> Client:
    client = Client()
    login_verified(client, User.objects.create_superuser("operator", password="x" * 24))
    return client


@pytest.fixture
def gateway():
    process = start_gateway()
    yield process
    assert process.stop() == 0, process.log_text()[-3000:]


def test_component_added_in_the_admin_comes_up_and_follows_changes(
    xmpp_server_factory, operator_client, gateway
):
    prosody = xmpp_server_factory("prosody", [(JID, SECRET)])
    tenant = Tenant.objects.create(name="pickup")
    app = App.objects.create(tenant=tenant, name="conversations")
    wait_until(lambda: "gateway.started" in gateway.log_text(), timeout=30)
    assert handshake(prosody) == "ok"  # nobody holds the component yet

    add_url = reverse("admin:relay_component_add") + f"?tenant={tenant.pk}&app={app.pk}"
    page = operator_client.get(add_url)
    response = operator_client.post(
        add_url,
        changeform_data(
            page, jid=JID, host="127.0.0.1", port=str(prosody.component_port), new_secret=SECRET
        ),
    )
    assert response.status_code == 302
    component = Component.objects.get(jid=JID)
    change_url = reverse("admin:relay_component_change", args=[component.pk])

    # Added: the link comes up, the gateway now holds the component on Prosody's side.
    wait_until(lambda: getattr(link(component), "state", "") == "up", timeout=30)
    assert handshake(prosody) == "conflict"
    page = operator_client.get(change_url).content.decode()
    assert "relay-link-up" in page
    health = operator_client.get(reverse("admin:health"))
    assert health.context["links"].states["up"] == 1

    # Changed to a wrong secret: the link goes down and says why, on the component's page.
    operator_client.post(
        change_url, changeform_data(operator_client.get(change_url), new_secret="W" * 32)
    )
    wait_until(lambda: "not-authorized" in (link(component).last_error or ""), timeout=30)
    assert link(component).state != "up"
    assert "wrong secret (not-authorized)" in operator_client.get(change_url).content.decode()

    # Changed back: up again.
    operator_client.post(
        change_url, changeform_data(operator_client.get(change_url), new_secret=SECRET)
    )
    wait_until(lambda: link(component).state == "up", timeout=30)

    # Disabled (confirmed): the gateway lets go of the component.
    operator_client.post(
        reverse("admin:relay_component_changelist"),
        {"action": "disable", "post": "yes", "_selected_action": [component.pk]},
    )
    wait_until(lambda: link(component).state == "down", timeout=30)
    wait_until(lambda: handshake(prosody) == "ok", timeout=30)

    # Enabled again, then deleted (confirmed): up, then let go for good.
    operator_client.post(
        reverse("admin:relay_component_changelist"),
        {"action": "enable", "index": "0", "_selected_action": [component.pk]},
    )
    wait_until(lambda: link(component).state == "up", timeout=30)
    response = operator_client.post(
        reverse("admin:relay_component_delete", args=[component.pk]), {"post": "yes"}
    )
    assert response.status_code == 302 and not Component.objects.filter(pk=component.pk).exists()
    wait_until(lambda: handshake(prosody) == "ok", timeout=30)
    assert gateway.alive()
    assert gateway.log_text().count('"gateway.link_added"') >= 3
