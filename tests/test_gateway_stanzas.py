"""The gateway's answers, stanza by stanza, with the test playing the user's XMPP server.

Real servers only send well-formed publishes from their own domain; here the test sends what
a buggy or hostile server (or user) could, and checks the answer types that decide whether
users keep their push (docs/protocols.md 1.3).
"""

from __future__ import annotations

import json
import re
import socket
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from relay.models import App, Component, ComponentLink, Registration, Service, Tenant
from relay.services.registrations import register_device
from tests.support import broker
from tests.support.component_server import FakeXmppServer, error_of
from tests.support.processes import start_gateway
from tests.support.waiting import wait_until

# On the embedded defaults, the tests marked `defaults` below stand for the module: what the
# others test does not depend on the database or the broker, and each starts a gateway.
pytestmark = [pytest.mark.django_db(transaction=True)]

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
    # These tests read what a publish queued, so the gateway leaves every send to the
    # workers (tests/test_direct_sends.py and the end-to-end tests cover its own sends).
    env = {"RELAY_DIRECT_SEND_SHARE": "0", **(getattr(request, "param", {}) or {})}
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
        server.wait_connected(gateway=gateway)
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


@pytest.mark.defaults
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


@pytest.mark.defaults
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


@pytest.mark.defaults
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
    lab.server.wait_connected(count=2, gateway=lab.gateway)
    assert lab.publish().get("type") == "result"


@pytest.mark.defaults
def test_lost_link_is_reestablished(lab):
    lab.server.drop_connection()
    lab.server.wait_connected(count=2, gateway=lab.gateway)
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
        server.wait_connected(gateway=gateway)
        wait_until(lambda: ComponentLink.objects.filter(component=component, state="up").exists())
        assert '"link.wrong_secret"' in gateway.log_text()
    finally:
        assert gateway.stop() == 0
        server.close()


def test_sigterm_stops_the_gateway_cleanly(lab):
    assert lab.gateway.stop() == 0
    wait_until(lambda: ComponentLink.objects.filter(component=lab.component, state="down").exists())
    assert '"gateway.stopped"' in lab.gateway.log_text()


# --- hostile input (issue 8: the gateway under hostile input)

STREAM_ERROR = "<stream:error><{} xmlns='urn:ietf:params:xml:ns:xmpp-streams'/></stream:error>"
LONG_LOCALPART = "a" * 3000 + "@localhost"


def disco_xml(iq_id, sender):
    sender_attr = f" from='{sender}'" if sender is not None else ""
    return (
        f"<iq type='get'{sender_attr} to='{COMPONENT}' id='{iq_id}'>"
        "<query xmlns='http://jabber.org/protocol/disco#info'/></iq>"
    )


def error_lines(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if '"level": "ERROR"' in line]


def link_down_events(log_text: str) -> list[dict]:
    return [
        json.loads(line)
        for line in log_text.splitlines()
        if line.startswith("{") and '"event": "link.down"' in line
    ]


@pytest.mark.parametrize("sender", ["@@@", "a@b@c", LONG_LOCALPART])
def test_a_sender_that_is_not_a_jid_gets_jid_malformed(lab, sender):
    """It used to get no answer at all (slixmpp's reply parses the address and raised)."""
    reply = lab.publish(sender=sender)
    assert error_of(reply) == ("modify", "jid-malformed")
    assert reply.get("to") == sender  # addressed back as given, escaped, never parsed
    assert reply.get("from") == COMPONENT
    fields = {"token": "t", "device-id": "d"}
    assert error_of(lab.command("register-push-fcm", fields, sender=sender)) == (
        "modify",
        "jid-malformed",
    )
    iq_id = lab.next_id()
    assert error_of(lab.server.request(disco_xml(iq_id, sender), iq_id)) == (
        "modify",
        "jid-malformed",
    )
    assert lab.publish().get("type") == "result"
    assert Registration.objects.count() == 1
    log_text = lab.gateway.log_text()
    assert "Task exception was never retrieved" not in log_text
    assert error_lines(log_text) == []


def test_an_iq_without_a_sender_gets_jid_malformed(lab):
    iq_id = lab.next_id()
    assert error_of(lab.server.request(disco_xml(iq_id, None), iq_id)) == (
        "modify",
        "jid-malformed",
    )


def test_a_parse_error_ends_the_stream_well_formed_and_never_echoes_input(lab):
    marker = "do-not-echo-" + "m" * 20
    valid = "".join(
        publish_xml(f"before{i}", lab.node, lab.secret, body=marker + "x" * 3000) for i in range(40)
    )
    lab.server.send(valid + f"<iq type='set' id='{marker}'><unclosed {marker}></iq>")
    lab.server.wait_stream_error("not-well-formed")
    lab.server.wait_connected(count=2, gateway=lab.gateway)
    first_stream = bytes(lab.server.received[0])
    assert STREAM_ERROR.format("not-well-formed").encode() + b"</stream:stream>" in first_stream
    assert marker.encode() not in first_stream
    assert lab.server.not_well_formed == 0  # what the gateway wrote always parsed
    assert lab.publish().get("type") == "result"


def test_a_link_dropped_by_bad_input_comes_back_after_the_shortest_delay(lab):
    """The delay used to double at every drop (reset only after 30 s up): 1, 1.5, 3, 8 s..."""
    for count in range(2, 8):
        lab.server.send("<iq type='set' id='broken'><unclosed></iq>")
        lab.server.wait_connected(count=count, gateway=lab.gateway)
    downs = link_down_events(lab.gateway.log_text())
    assert len(downs) >= 6
    # service_env: RELAY_RECONNECT_MIN_SECONDS=0.2; every wait is drawn from [min/2, min].
    assert max(down["retry_in"] for down in downs) <= 0.2
    assert all(down["reason"] == "we closed the stream: not-well-formed" for down in downs)
    assert lab.publish().get("type") == "result"


def test_while_connecting_fails_the_delay_grows_and_nothing_is_left_pending(transactional_db):
    """Backoff holds while the server refuses us; and no slixmpp task is left pending on a
    dropped link ("Task was destroyed but it is pending!" used to be logged at ERROR)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there: every attempt is refused
    make_component(port)
    gateway = start_gateway()
    try:
        wait_until(lambda: len(link_down_events(gateway.log_text())) >= 8, timeout=30)
    finally:
        assert gateway.stop() == 0
    log_text = gateway.log_text()
    waits = [down["retry_in"] for down in link_down_events(log_text)]
    assert max(waits) > 0.8  # it grew from [0.1, 0.2] towards RELAY_RECONNECT_MAX_SECONDS=2
    assert "Task was destroyed but it is pending" not in log_text
    assert error_lines(log_text) == []


@pytest.mark.parametrize("lab", [{"RELAY_MAX_STANZA_BYTES": "32768"}], indirect=True)
def test_a_stanza_over_the_size_limit_ends_the_stream_before_it_is_read_whole(lab):
    """10 MB stanzas used to be accepted. Only a few KB past the limit are sent here: a gateway
    that waited for the stanza's end (buffering it) would never answer."""
    opening = (
        "<iq type='set' from='localhost' to='push.localhost' id='big'>"
        "<pubsub xmlns='http://jabber.org/protocol/pubsub'><publish node='x'><item>"
        "<notification xmlns='urn:xmpp:push:0'><x xmlns='jabber:x:data'>"
        "<field var='last-message-body'><value>"
    )
    lab.server.send(opening + "y" * (32768 + 3 * 4096))
    lab.server.wait_stream_error("policy-violation")
    lab.server.wait_connected(count=2, gateway=lab.gateway)
    # A start tag that never ends (one huge attribute) is no different.
    lab.server.send("<iq type='set' from='localhost' id='" + "z" * (32768 + 3 * 4096))
    lab.server.wait_connected(count=3, gateway=lab.gateway)
    assert lab.server.stream_errors == ["policy-violation", "policy-violation"]
    assert b"yyyy" not in bytes(lab.server.received[0])
    # Below the limit all is as before.
    assert lab.publish(body="w" * 4000).get("type") == "result"


def test_a_stanza_nested_deeper_than_the_limit_ends_the_stream(lab):
    lab.server.send(
        "<iq type='set' from='localhost' to='push.localhost' id='deep'>" + "<a xmlns='x'>" * 1000
    )
    lab.server.wait_stream_error("policy-violation")
    lab.server.wait_connected(count=2, gateway=lab.gateway)
    # 20 levels (within RELAY_MAX_STANZA_DEPTH=32) are only a payload we do not serve.
    deep = lab.ask(
        "<iq type='get' from='localhost' to='push.localhost' id='{id}'>"
        + "<a xmlns='x'>" * 20
        + "</a>" * 20
        + "</iq>"
    )
    assert error_of(deep) == ("cancel", "service-unavailable")


def test_a_dtd_before_the_stream_header_is_refused(transactional_db):
    """Entities declared there could expand small input into huge text."""
    server = FakeXmppServer(
        COMPONENT, SECRET, header_prefix=b"<!DOCTYPE stream:stream [<!ENTITY a 'aaaa'>]>"
    )
    make_component(server.port)
    gateway = start_gateway()
    try:
        server.wait_stream_error("restricted-xml")
        wait_until(lambda: server.accepted >= 2)  # it tries again, as after any bad input
        assert server.connections == 0  # and never sent its handshake into such a stream
    finally:
        assert gateway.stop() == 0
        server.close()


def test_a_flood_of_hostile_stanzas_is_answered_and_valid_publishes_go_through(lab):
    """Every get/set iq gets its answer; the valid publishes among the flood are accepted.
    (How fast, under a much larger flood: bench/hostile.py.)"""
    expected = {
        "@@@": ("modify", "jid-malformed"),
        "a@b@c": ("modify", "jid-malformed"),
        "nonode": ("modify", "bad-request"),
        "huge": ("modify", "bad-request"),
        "unknown": ("cancel", "item-not-found"),
        "wrong": ("auth", "forbidden"),
        "full": ("auth", "forbidden"),
        "vcard": ("cancel", "service-unavailable"),
    }
    hostile = {
        "@@@": lambda i: publish_xml(i, lab.node, lab.secret, sender="@@@"),
        "a@b@c": lambda i: publish_xml(i, lab.node, lab.secret, sender="a@b@c"),
        "nonode": lambda i: publish_xml(i, None, lab.secret),
        "huge": lambda i: publish_xml(i, lab.node, lab.secret, body="y" * 5000),
        "unknown": lambda i: publish_xml(i, f"n{i}", lab.secret),
        "wrong": lambda i: publish_xml(i, lab.node, "wrong"),
        "full": lambda i: publish_xml(i, lab.node, lab.secret, sender="localhost/r"),
        "vcard": lambda i: (
            f"<iq type='get' from='localhost' to='{COMPONENT}' id='{i}'>"
            "<vCard xmlns='vcard-temp'/></iq>"
        ),
    }
    kinds = list(hostile)
    sent: dict[str, str] = {}
    chunks = []
    for number in range(1600):
        kind = kinds[number % len(kinds)]
        iq_id = f"h{number}-{kind}"
        sent[iq_id] = kind
        chunks.append(hostile[kind](iq_id))
        if number % 80 == 0:
            chunks.append(publish_xml(f"good{number}", lab.node, lab.secret))
    lab.server.send("".join(chunks))
    for number in range(0, 1600, 80):
        assert lab.server.reply_to(f"good{number}").get("type") == "result"
    for iq_id, kind in sent.items():
        assert error_of(lab.server.reply_to(iq_id)) == expected[kind], iq_id
    assert error_lines(lab.gateway.log_text()) == []


@pytest.mark.parametrize("lab", [{"RELAY_REGISTRATION_RATE_PER_DOMAIN": "2/3600"}], indirect=True)
def test_new_registrations_over_the_domain_rate_get_wait_and_re_registration_never(lab):
    completed = "{http://jabber.org/protocol/commands}command"
    first = lab.command("register-push-fcm", {"token": "t2", "device-id": "dev-2"})
    assert first.find(completed).get("status") == "completed"
    second = lab.command("register-push-fcm", {"token": "t3", "device-id": "dev-3"})
    assert second.find(completed).get("status") == "completed"
    refused = lab.command("register-push-fcm", {"token": "t4", "device-id": "dev-4"})
    assert error_of(refused) == ("wait", "resource-constraint")
    text = refused.find(".//{urn:ietf:params:xml:ns:xmpp-stanzas}text").text
    assert "too many new registrations from this domain" in text
    again = lab.command("register-push-fcm", {"token": "t2-new", "device-id": "dev-2"})
    assert form_values(again)["node"] == form_values(first)["node"]
    other = lab.command(
        "register-push-fcm", {"token": "t5", "device-id": "dev-5"}, sender="bob@elsewhere.org/x"
    )
    assert other.find(completed).get("status") == "completed"
    assert Registration.objects.count() == 4  # the lab's own, dev-2, dev-3 and bob's
