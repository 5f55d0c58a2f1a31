"""The gateway's answers, stanza by stanza, with the test playing the user's XMPP server.

Real servers only send well-formed publishes from their own domain; here the test sends what
a buggy or hostile server (or user) could, and checks the answer types that decide whether
users keep their push (docs/protocols.md 1.3).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from relay.models import App, Component, ComponentLink, Registration, Service, Tenant
from relay.services.registrations import register_device
from tests.support import broker
from tests.support.component_server import FakeXmppServer, error_of
from tests.support.processes import start_gateway, wait_until

pytestmark = [pytest.mark.defaults, pytest.mark.django_db(transaction=True)]

DATA = Path(__file__).parent / "data"
COMPONENT = "push.localhost"
SECRET = "s3cr3t"

PUBLISH = (
    "<iq type='set' from='{sender}' to='push.localhost' id='{id}'>"
    "<pubsub xmlns='http://jabber.org/protocol/pubsub'><publish{node_attr}><item>"
    "<notification xmlns='urn:xmpp:push:0'><x xmlns='jabber:x:data' type='form'>"
    "<field var='FORM_TYPE' type='hidden'><value>urn:xmpp:push:summary</value></field>"
    "<field var='message-count'><value>1</value></field>"
    "<field var='last-message-body'><value>{body}</value></field>"
    "</x></notification></item></publish>{options}</pubsub></iq>"
)
OPTIONS = (
    "<publish-options><x xmlns='jabber:x:data' type='submit'><field var='FORM_TYPE'>"
    "<value>http://jabber.org/protocol/pubsub#publish-options</value></field>"
    "<field var='secret'><value>{secret}</value></field></x></publish-options>"
)


def publish_xml(iq_id, node, secret, *, sender="localhost", body="New Message!", options=True):
    return PUBLISH.format(
        sender=sender,
        id=iq_id,
        node_attr=f" node='{node}'" if node is not None else "",
        body=body,
        options=OPTIONS.format(secret=secret) if options else "",
    )


def command_xml(iq_id, node, fields, *, sender="alice@localhost/phone", form=True):
    values = "".join(f"<field var='{k}'><value>{v}</value></field>" for k, v in fields.items())
    form_xml = f"<x xmlns='jabber:x:data' type='submit'>{values}</x>" if form else ""
    return (
        f"<iq type='set' from='{sender}' to='{COMPONENT}' id='{iq_id}'>"
        f"<command xmlns='http://jabber.org/protocol/commands' action='execute' node='{node}'>"
        f"{form_xml}</command></iq>"
    )


def form_values(reply: ET.Element) -> dict[str, str]:
    values = {}
    for field in reply.iter("{jabber:x:data}field"):
        value = field.find("{jabber:x:data}value")
        values[field.get("var")] = value.text if value is not None else ""
    return values


class Lab:
    """A fake server, our gateway connected to it, and one registered device."""

    def __init__(self, server, gateway, component, registration):
        self.server = server
        self.gateway = gateway
        self.component = component
        self.node = registration.node
        self.secret = registration.secret
        self._ids = 0

    def next_id(self) -> str:
        self._ids += 1
        return f"t{self._ids}"

    def ask(self, xml_template: str, **kwargs) -> ET.Element:
        iq_id = self.next_id()
        return self.server.request(xml_template.format(id=iq_id, **kwargs), iq_id)

    def publish(self, **kwargs) -> ET.Element:
        iq_id = self.next_id()
        values = {"node": self.node, "secret": self.secret, **kwargs}
        node, secret = values.pop("node"), values.pop("secret")
        return self.server.request(publish_xml(iq_id, node, secret, **values), iq_id)

    def command(self, node, fields, **kwargs) -> ET.Element:
        iq_id = self.next_id()
        return self.server.request(command_xml(iq_id, node, fields, **kwargs), iq_id)


def make_component(port: int) -> Component:
    tenant = Tenant.objects.create(name="lab")
    app = App.objects.create(tenant=tenant, name="app")
    return Component.objects.create(
        tenant=tenant, app=app, jid=COMPONENT, secret=SECRET, host="127.0.0.1", port=port
    )


@pytest.fixture
def lab(request):
    env = getattr(request, "param", {}) or {}
    server = FakeXmppServer(COMPONENT, SECRET)
    component = make_component(server.port)
    registration = register_device(
        component=component,
        service=Service.FCM,
        bare_jid="alice@localhost",
        device_id="dev-1",
        token="tok-1",
    )
    broker.purge()
    gateway = start_gateway(**env)
    try:
        server.wait_connected()
        yield Lab(server, gateway, component, registration)
        # Nothing a test sent may crash the gateway (a test may have stopped it on purpose).
        assert gateway.process.returncode in (None, 0), gateway.log_text()[-3000:]
    finally:
        assert gateway.stop() == 0, gateway.log_text()[-3000:]
        server.close()
        broker.purge()


def test_disco_info_announces_a_push_service(lab):
    reply = lab.ask(
        "<iq type='get' from='alice@localhost/phone' to='push.localhost' id='{id}'>"
        "<query xmlns='http://jabber.org/protocol/disco#info'/></iq>"
    )
    assert reply.get("type") == "result"
    identity = reply.find(".//{http://jabber.org/protocol/disco#info}identity")
    assert (identity.get("category"), identity.get("type")) == ("pubsub", "push")
    features = {f.get("var") for f in reply.iter("{http://jabber.org/protocol/disco#info}feature")}
    assert {"urn:xmpp:push:0", "http://jabber.org/protocol/commands"} <= features


def test_disco_items_list_the_commands(lab):
    reply = lab.ask(
        "<iq type='get' from='alice@localhost/phone' to='push.localhost' id='{id}'>"
        "<query xmlns='http://jabber.org/protocol/disco#items' "
        "node='http://jabber.org/protocol/commands'/></iq>"
    )
    nodes = {i.get("node") for i in reply.iter("{http://jabber.org/protocol/disco#items}item")}
    assert {
        "register-push-fcm",
        "register-push-apns",
        "unregister-push-fcm",
        "unregister-push-apns",
    } <= nodes


def test_the_seed_request_of_conversations_is_completed_with_node_and_secret(lab):
    seed = (DATA / "conversations-register-push-fcm.xml").read_text()
    seed = seed.replace('to="p2.siacs.eu"', f'to="{COMPONENT}"')
    reply = lab.server.request(seed, "cXo5bNCF6wgD")
    assert reply.get("type") == "result"
    command = reply.find("{http://jabber.org/protocol/commands}command")
    assert command.get("status") == "completed"
    assert command.get("action") is None
    values = form_values(reply)
    assert values["jid"] == COMPONENT
    assert re.fullmatch(r"[A-Za-z0-9_-]{12}", values["node"])
    assert len(values["secret"]) == 24
    stored = Registration.objects.get(node=values["node"])
    assert stored.device_hash == "ec164939a8485ee6b7f7871071a11c7bb18aead5"
    assert stored.account_domain == "jabber.de"
    assert stored.token.startswith("eeDXSJjASJY:APA91b")

    again = form_values(lab.server.request(seed.replace("cXo5bNCF6wgD", "again"), "again"))
    assert (again["node"], again["secret"]) == (values["node"], values["secret"])


def test_command_errors(lab):
    fields = {"token": "t", "device-id": "d"}
    assert error_of(lab.command("register-push-fcm", fields, form=False)) == (
        "modify",
        "bad-request",
    )
    assert error_of(lab.command("register-push-fcm", {"device-id": "d"})) == (
        "modify",
        "bad-request",
    )
    assert error_of(lab.command("register-push-fcm", {"token": "t"})) == ("modify", "bad-request")
    room = {**fields, "muc": "room@conference.localhost/nick"}
    assert error_of(lab.command("register-push-fcm", room)) == ("modify", "bad-request")
    assert error_of(lab.command("register-push-gcm", fields)) == ("cancel", "item-not-found")
    assert error_of(lab.command("unregister-push-fcm", {"device-id": "nothing"})) == (
        "cancel",
        "item-not-found",
    )
    assert error_of(lab.command("register-push-fcm", fields, sender="localhost")) == (
        "modify",
        "bad-request",
    )
    huge = {"token": "x" * 10_000, "device-id": "d"}
    assert error_of(lab.command("register-push-fcm", huge)) == ("modify", "bad-request")
    assert Registration.objects.count() == 1


def test_register_a_room_and_unregister(lab):
    fields = {"token": "t", "android-id": "d", "muc": "room@conference.localhost"}
    reply = lab.command("register-push-apns", fields)
    assert reply.find("{http://jabber.org/protocol/commands}command").get("status") == "completed"
    registration = Registration.objects.get(node=form_values(reply)["node"])
    assert registration.service == Service.APNS and registration.room_hash
    done = lab.command(
        "unregister-push-apns", {"device-id": "d", "muc": "room@conference.localhost"}
    )
    assert done.find("{http://jabber.org/protocol/commands}command").get("status") == "completed"
    assert not Registration.objects.filter(pk=registration.pk).exists()


def test_publish_answers(lab):
    assert lab.publish().get("type") == "result"
    assert len(broker.queued_jobs()) == 1
    assert error_of(lab.publish(secret="wrong")) == ("auth", "forbidden")
    assert error_of(lab.publish(options=False)) == ("auth", "forbidden")
    assert error_of(lab.publish(node="unknown")) == ("cancel", "item-not-found")
    assert error_of(lab.publish(sender="elsewhere.org")) == ("cancel", "item-not-found")
    assert error_of(lab.publish(node=None)) == ("modify", "bad-request")
    assert error_of(lab.publish(sender="localhost/resource")) == ("auth", "forbidden")
    assert error_of(lab.publish(sender="alice@localhost/phone")) == ("auth", "forbidden")
    assert error_of(lab.publish(body="x" * 100_000)) == ("modify", "bad-request")
    assert broker.queued_jobs() == []


def test_publish_from_the_users_bare_jid_is_accepted(lab):
    assert lab.publish(sender="alice@localhost").get("type") == "result"
    [job] = broker.queued_jobs()
    assert job["publishing_domain"] == "localhost"


def test_odd_iqs_get_an_answer_or_none_but_never_stall_the_gateway(lab):
    unknown = lab.ask(
        "<iq type='get' from='localhost' to='push.localhost' id='{id}'>"
        "<vcard xmlns='vcard-temp'/></iq>"
    )
    assert error_of(unknown) == ("cancel", "service-unavailable")
    empty = lab.ask("<iq type='set' from='localhost' to='push.localhost' id='{id}'/>")
    assert error_of(empty) == ("modify", "bad-request")
    two = lab.ask(
        "<iq type='set' from='localhost' to='push.localhost' id='{id}'>"
        "<a xmlns='x'/><b xmlns='y'/></iq>"
    )
    assert error_of(two) == ("modify", "bad-request")
    # Results and errors are never answered, nor are iqs of unknown type.
    for iq_type in ("result", "error", "bogus"):
        lab.server.send(
            f"<iq type='{iq_type}' from='localhost' to='push.localhost' id='quiet-{iq_type}'/>"
        )
    # A flood of hostile stanzas, then a valid publish still gets its answer.
    flood = "".join(
        publish_xml(f"flood{i}", "x" * (i % 80), "s", body="y" * 5000) for i in range(200)
    )
    lab.server.send(flood)
    assert lab.publish().get("type") == "result"
    answered = {s.get("id") for s in lab.server.stanzas}
    assert not {"quiet-result", "quiet-error", "quiet-bogus"} & answered
    assert {f"flood{i}" for i in range(200)} <= answered


def test_messages_and_presence_are_ignored_without_crashing(lab):
    lab.server.send(
        "<message from='alice@localhost/phone' to='push.localhost'><body>hi</body></message>"
        "<presence from='alice@localhost/phone' to='push.localhost'/>"
    )
    assert lab.publish().get("type") == "result"


def test_malformed_xml_from_the_server_makes_the_gateway_reconnect(lab):
    lab.server.send("<iq type='set' id='broken'><unclosed></iq>")
    lab.server.wait_connected(count=2)
    assert lab.publish().get("type") == "result"


def test_lost_link_is_reestablished(lab):
    lab.server.drop_connection()
    lab.server.wait_connected(count=2)
    assert lab.publish().get("type") == "result"
    wait_until(lambda: ComponentLink.objects.filter(component=lab.component, state="up").exists())


def test_wrong_component_secret_is_reported_and_retried(transactional_db):
    server = FakeXmppServer(COMPONENT, "the-real-secret")
    component = make_component(server.port)
    gateway = start_gateway()
    try:
        link = wait_until(
            lambda: ComponentLink.objects.filter(
                component=component, last_error__contains="wrong secret"
            ).first()
        )
        assert link.state != "up"
        wait_until(lambda: server.handshakes_refused >= 2)  # it keeps trying, with backoff
        Component.objects.filter(pk=component.pk).update(secret="the-real-secret")
        server.wait_connected()
        wait_until(lambda: ComponentLink.objects.filter(component=component, state="up").exists())
        assert '"link.wrong_secret"' in gateway.log_text()
    finally:
        assert gateway.stop() == 0
        server.close()


def test_sigterm_stops_the_gateway_cleanly(lab):
    assert lab.gateway.stop() == 0
    wait_until(lambda: ComponentLink.objects.filter(component=lab.component, state="down").exists())
    assert '"gateway.stopped"' in lab.gateway.log_text()
