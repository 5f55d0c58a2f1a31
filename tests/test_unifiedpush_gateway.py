"""The gateway's side of UnifiedPush, stanza by stanza, with the test playing the XMPP server.

The test stands where Prosody would: it sends the register iq a phone would send (through
its server), POSTs to the endpoint through the web app, reads the `<push>` iq our gateway
(a real process) sends and answers it as the phone would: result, item-not-found,
service-unavailable, nothing, or a forgery. Real Prosody and a real phone client are in
test_unifiedpush_e2e.py.
"""

from __future__ import annotations

import base64
import os
import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from urllib.parse import urlsplit

import pytest

from relay.models import App, Component, Tenant
from relay.unifiedpush.models import UnifiedPushDelivery, UnifiedPushMessage, UnifiedPushRevocation
from relay.unifiedpush.services import UP_NS, messages
from tests.support.component_server import FakeXmppServer, error_of
from tests.support.processes import start_gateway
from tests.support.unifiedpush_components import serving_unifiedpush
from tests.support.waiting import holds_for, wait_until

# On the embedded defaults, the tests marked `defaults` below stand for the module: what the
# others test does not depend on the database or the broker, and each starts a gateway.
pytestmark = [pytest.mark.django_db(transaction=True)]

COMPONENT = "up.localhost"
SECRET = "s3cr3t"
BASE = "https://push.example.org"
PHONE = "juliet@localhost/Conversations.r4nD"
PUSH = f"{{{UP_NS}}}push"
GATEWAY_ENV = {
    "RELAY_UNIFIEDPUSH_RETRY_BASE_SECONDS": "0.5",
    "RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS": "1",
    "RELAY_UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS": "2",
    "RELAY_UNIFIEDPUSH_SWEEP_SECONDS": "0.2",
}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class Lab:
    def __init__(self, server: FakeXmppServer, component: Component, push_client) -> None:
        self.server = server
        self.component = component
        self.push_client = push_client
        self.gateway = None
        self._ids = 0
        self.answered: set[str] = set()

    def start_gateway(self, **env: str) -> None:
        self.gateway = start_gateway(**{**GATEWAY_ENV, **env})
        self.server.wait_connected(count=self.server.connections + 1, gateway=self.gateway)

    def iq(self, body: str, *, sender: str = PHONE, iq_type: str = "set") -> ET.Element:
        self._ids += 1
        iq_id = f"t{self._ids}"
        return self.server.request(
            f"<iq type='{iq_type}' from='{sender}' to='{COMPONENT}' id='{iq_id}'>{body}</iq>",
            iq_id,
        )

    def register(
        self, *, sender: str = PHONE, application: str | None = None, instance: str | None = None
    ) -> ET.Element:
        application = b64(os.urandom(32)) if application is None else application
        instance = b64(os.urandom(32)) if instance is None else instance
        return self.iq(
            f"<register xmlns='{UP_NS}' application='{application}' instance='{instance}'/>",
            sender=sender,
        )

    def endpoint(self, sender: str = PHONE) -> str:
        reply = self.register(sender=sender)
        registered = reply.find(f"{{{UP_NS}}}registered")
        assert registered is not None, ET.tostring(reply)
        return registered.get("endpoint")

    def post(self, endpoint: str, body: bytes = b"hello", **headers: str):
        return self.push_client.post(
            urlsplit(endpoint).path,
            data=body,
            content_type="application/octet-stream",
            headers=headers,
        )

    def pushes(self, count: int = 1, timeout: float = 10.0) -> list[ET.Element]:
        return self.server.wait_for(lambda s: s.find(PUSH) is not None, timeout, count=count)

    def all_pushes(self) -> list[ET.Element]:
        """Every push the gateway sent so far."""
        return [s for s in list(self.server.stanzas) if s.find(PUSH) is not None]

    def next_push(self, timeout: float = 10.0) -> ET.Element:
        """The first push not answered yet."""
        [push] = self.server.wait_for(
            lambda s: s.find(PUSH) is not None and s.get("id") not in self.answered, timeout
        )
        return push

    def answer(
        self,
        push: ET.Element,
        condition: str | None = None,
        *,
        sender: str | None = None,
        error_type: str = "cancel",
    ) -> None:
        self.answered.add(push.get("id"))
        sender = sender or push.get("to")
        if condition is None:
            self.server.send(
                f"<iq type='result' id='{push.get('id')}' from='{sender}' to='{COMPONENT}'/>"
            )
        else:
            self.server.send(
                f"<iq type='error' id='{push.get('id')}' from='{sender}' to='{COMPONENT}'>"
                f"<error type='{error_type}'><{condition} "
                "xmlns='urn:ietf:params:xml:ns:xmpp-stanzas'/></error></iq>"
            )


@pytest.fixture
def lab(push_client):
    messages.reset_limits()
    server = FakeXmppServer(COMPONENT, SECRET)
    tenant = Tenant.objects.create(name="lab", allowed_domains="localhost\n*.example.net")
    component = serving_unifiedpush(
        tenant=tenant,
        jid=COMPONENT,
        secret=SECRET,
        host="127.0.0.1",
        port=server.port,
        endpoint_url=BASE,
    )
    lab = Lab(server, component, push_client)
    lab.start_gateway()
    try:
        yield lab
    finally:
        code = lab.gateway.stop()
        server.close()
        assert code == 0, lab.gateway.log_text()[-3000:]
        log = lab.gateway.log_text()
        for secret in ("juliet", "Conversations.r4nD", "hello"):
            assert secret not in log, "the gateway log names an account or a body"


def body_of(push: ET.Element) -> bytes:
    return base64.b64decode(push.find(PUSH).text or "")


def bodies() -> list[bytes]:
    return [
        messages.open_message(bytes(row.sealed)).body
        for row in UnifiedPushMessage.objects.order_by("id")
    ]


# --- registering


@pytest.mark.defaults
def test_register_answers_an_endpoint_and_an_iso_expiration(lab):
    reply = lab.register()
    assert reply.get("type") == "result", ET.tostring(reply)
    registered = reply.find(f"{{{UP_NS}}}registered")
    endpoint, expiration = registered.get("endpoint"), registered.get("expiration")
    assert endpoint.startswith(BASE + "/push/v4.local.") and len(endpoint.encode()) <= 1000
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.000Z", expiration)
    expires = datetime.strptime(expiration, "%Y-%m-%dT%H:%M:%S.000Z").replace(tzinfo=UTC)
    assert abs((expires - datetime.now(UTC)).total_seconds() - 7 * 86400) < 60
    again = lab.register().find(f"{{{UP_NS}}}registered")
    assert again.get("endpoint") != endpoint
    assert lab.post(endpoint).status_code == 201  # the first one still works


@pytest.mark.parametrize(
    "application, instance",
    [
        ("", None),
        ("not base64!", None),
        (b64(os.urandom(31)), None),
        (None, b64(os.urandom(33))),
        (b64(os.urandom(32))[:-1], None),
        (b64(os.urandom(48)), None),
    ],
)
def test_register_refuses_anything_but_base64_of_32_bytes(lab, application, instance):
    assert error_of(lab.register(application=application, instance=instance)) == (
        "modify",
        "bad-request",
    )


def test_register_needs_the_full_jid_of_an_account(lab):
    assert error_of(lab.register(sender="juliet@localhost")) == ("modify", "bad-request")
    assert error_of(lab.register(sender="localhost")) == ("modify", "bad-request")


def test_register_refuses_accounts_of_domains_the_tenant_does_not_allow(lab):
    assert error_of(lab.register(sender="eve@evil.example/phone")) == ("auth", "forbidden")
    assert lab.register(sender="bob@chat.example.net/phone").get("type") == "result"


def test_register_waits_while_the_tenant_is_suspended(lab):
    Tenant.objects.filter(pk=lab.component.tenant_id).update(suspended=True)
    assert error_of(lab.register()) == ("wait", "resource-constraint")


def test_a_unifiedpush_only_component_refuses_p2_and_says_what_it_serves(lab):
    info = lab.iq("<query xmlns='http://jabber.org/protocol/disco#info'/>", iq_type="get")
    features = {f.get("var") for f in info.iter("{http://jabber.org/protocol/disco#info}feature")}
    assert UP_NS in features
    assert "http://jabber.org/protocol/commands" not in features
    command = lab.iq(
        "<command xmlns='http://jabber.org/protocol/commands' node='register-push-fcm' "
        "action='execute'><x xmlns='jabber:x:data' type='submit'><field var='token'>"
        "<value>t</value></field><field var='device-id'><value>d</value></field></x></command>"
    )
    assert error_of(command) == ("cancel", "service-unavailable")
    publish = lab.iq(
        "<pubsub xmlns='http://jabber.org/protocol/pubsub'><publish node='n'/></pubsub>",
        sender="localhost",
    )
    assert error_of(publish) == ("cancel", "item-not-found")


# --- relaying


@pytest.mark.defaults
def test_a_post_becomes_a_push_iq_to_the_full_jid_and_result_deletes_it(lab):
    endpoint = lab.endpoint()
    response = lab.post(endpoint, b"\x00binary\xffbody")
    assert response.status_code == 201
    push = lab.next_push()
    assert push.get("to") == PHONE and push.get("from") == COMPONENT
    assert push.get("type") == "set"
    element = push.find(PUSH)
    assert len(base64.b64decode(element.get("application"))) == 32
    assert len(base64.b64decode(element.get("instance"))) == 32
    assert body_of(push) == b"\x00binary\xffbody"
    lab.answer(push)
    record = wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="delivered").first())
    assert not UnifiedPushMessage.objects.exists()
    assert record.size == len(b"\x00binary\xffbody") and record.attempts == 1
    assert record.finished >= record.received


@pytest.mark.parametrize("condition", ["item-not-found", "feature-not-implemented"])
def test_a_refusing_phone_revokes_the_endpoint(lab, condition):
    endpoint, other = lab.endpoint(), lab.endpoint()
    lab.post(endpoint, b"one")
    lab.answer(lab.next_push(), condition)
    wait_until(lambda: UnifiedPushRevocation.objects.exists())
    assert lab.post(endpoint).status_code == 404
    assert lab.post(other).status_code == 201
    assert UnifiedPushDelivery.objects.get().outcome == "revoked"


@pytest.mark.defaults
def test_a_temporary_error_keeps_the_message_and_retries_in_order(lab):
    endpoint = lab.endpoint()
    lab.post(endpoint, b"first")
    lab.answer(lab.next_push(), "service-unavailable")
    wait_until(lambda: UnifiedPushMessage.objects.filter(attempts=1).exists())
    lab.post(endpoint, b"second")
    lab.post(endpoint, b"third")
    probe = lab.next_push()  # after the backoff: the oldest alone
    assert body_of(probe) == b"first"
    holds_for(
        lambda: [body_of(p) for p in lab.all_pushes()] == [b"first", b"first"],
        0.5,
        "nothing else is sent before the probe's answer",
    )
    lab.answer(probe)
    rest = [
        lab.next_push(),
    ]
    lab.answer(rest[0])
    rest.append(lab.next_push())
    lab.answer(rest[1])
    assert [body_of(p) for p in rest] == [b"second", b"third"]
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="delivered").count() == 3)
    assert not UnifiedPushMessage.objects.exists()


def test_an_answer_from_someone_else_is_ignored(lab):
    endpoint = lab.endpoint()
    lab.post(endpoint, b"mine")
    push = lab.next_push()
    lab.answer(push, "item-not-found", sender="mallory@localhost/x")
    lab.answer(push, sender="mallory@localhost/x")
    holds_for(
        lambda: (
            UnifiedPushMessage.objects.count() == 1 and not UnifiedPushRevocation.objects.exists()
        ),
        0.5,
        "someone else's answers change nothing",
    )
    lab.answer(push)  # the phone itself
    wait_until(lambda: not UnifiedPushMessage.objects.exists())


def test_no_answer_is_temporary_and_a_late_result_still_counts_once(lab):
    endpoint = lab.endpoint()
    lab.post(endpoint, b"slow")
    first = lab.next_push()
    lab.answered.add(first.get("id"))  # the phone says nothing for now
    wait_until(lambda: UnifiedPushMessage.objects.filter(attempts=1).exists())
    lab.answer(first)  # late
    wait_until(lambda: not UnifiedPushMessage.objects.exists())
    records = UnifiedPushDelivery.objects.all()
    assert [r.outcome for r in records] == ["delivered"]


def away_for_ten_minutes(lab, condition: str) -> str:
    """A phone whose first push failed with `condition`; retries would wait ten minutes."""
    endpoint = lab.endpoint()
    lab.gateway.stop()
    lab.start_gateway(
        RELAY_UNIFIEDPUSH_RETRY_BASE_SECONDS="600", RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS="600"
    )
    lab.post(endpoint, b"one")
    lab.answer(lab.next_push(), condition)
    wait_until(lambda: UnifiedPushMessage.objects.filter(attempts=1).exists())
    return endpoint


def test_directed_presence_brings_a_phone_back_at_once(lab):
    endpoint = away_for_ten_minutes(lab, "service-unavailable")
    lab.post(endpoint, b"two")
    holds_for(lambda: len(lab.all_pushes()) == 1, 0.6, "held back for ten minutes")
    lab.server.send(f"<presence from='{PHONE}' to='{COMPONENT}'/>")
    first = lab.next_push()
    lab.answer(first)
    second = lab.next_push()
    lab.answer(second)
    assert [body_of(first), body_of(second)] == [b"one", b"two"]
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="delivered").count() == 2)


def test_registering_again_brings_a_phone_back_too(lab):
    away_for_ten_minutes(lab, "recipient-unavailable")
    lab.register()
    push = lab.next_push()
    assert body_of(push) == b"one"
    lab.answer(push)
    wait_until(lambda: not UnifiedPushMessage.objects.exists())


def test_a_message_whose_ttl_passes_while_the_phone_is_away_expires(lab):
    endpoint = lab.endpoint()
    lab.post(endpoint, b"short-lived", TTL="1")
    lab.answer(lab.next_push(), "service-unavailable")
    record = wait_until(lambda: UnifiedPushDelivery.objects.first())
    assert record.outcome == "expired" and record.ttl == 1
    assert not UnifiedPushMessage.objects.exists()
    tried = len(lab.all_pushes())  # the first push, and maybe a retry within the second
    lab.server.send(f"<presence from='{PHONE}' to='{COMPONENT}'/>")
    holds_for(lambda: len(lab.all_pushes()) == tried, 0.5, "once expired, not sent again")


def test_ttl_zero_is_tried_once_and_never_kept(lab):
    endpoint = lab.endpoint()
    assert lab.post(endpoint, b"now or never", TTL="0")["TTL"] == "0"
    lab.answer(lab.next_push(), "service-unavailable")
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="expired").exists())
    assert not UnifiedPushMessage.objects.exists()


@pytest.mark.parametrize("direct", ["0.5", "0"], ids=["direct-path", "stored-path"])
def test_ttl_zero_for_a_phone_that_is_away_is_never_delivered_when_it_is_back(lab, direct):
    """RFC 8030 5.2: a zero TTL expires if the phone is unavailable, even for a moment."""
    endpoint = lab.endpoint()
    lab.gateway.stop()
    lab.start_gateway(
        RELAY_UNIFIEDPUSH_RETRY_BASE_SECONDS="600",
        RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS="600",
        RELAY_UNIFIEDPUSH_DIRECT_SECONDS=direct,
    )
    lab.post(endpoint, b"one")
    lab.answer(lab.next_push(), "service-unavailable")  # away: held back for ten minutes
    wait_until(lambda: UnifiedPushMessage.objects.filter(attempts=1).exists())
    assert lab.post(endpoint, b"now or never", TTL="0").status_code == 201
    assert lab.post(endpoint, b"two").status_code == 201
    lab.server.send(f"<presence from='{PHONE}' to='{COMPONENT}'/>")  # back at once
    while body_of(push := lab.next_push()) != b"two":
        lab.answer(push)
    lab.answer(push)
    # Oldest first: had the TTL-0 message been kept, it would have come before "two".
    assert [body_of(p) for p in lab.all_pushes()] == [b"one", b"one", b"two"]
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="delivered").count() == 2)
    assert UnifiedPushDelivery.objects.get(ttl=0).outcome == "expired"


@pytest.mark.parametrize("condition", ["service-unavailable", None], ids=["error", "silence"])
def test_a_message_the_phone_did_not_take_stays_deliverable_until_its_ttl(lab, condition):
    """The retry would come after the TTL (ten minutes against five): the message is kept
    until its TTL passes, and the phone's return brings it out."""
    endpoint = lab.endpoint()
    lab.gateway.stop()
    lab.start_gateway(
        RELAY_UNIFIEDPUSH_RETRY_BASE_SECONDS="600",
        RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS="600",
        RELAY_UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS="1",
    )
    lab.post(endpoint, b"keep me", TTL="300")
    first = lab.next_push()
    if condition:
        lab.answer(first, condition)
    else:
        lab.answered.add(first.get("id"))  # silence: the answer timeout passes
    row = wait_until(lambda: UnifiedPushMessage.objects.filter(attempts=1).first())
    assert row.next_attempt <= row.expires  # retried by its expiry at the latest
    assert not UnifiedPushDelivery.objects.exists()  # not ended with its TTL left
    lab.server.send(f"<presence from='{PHONE}' to='{COMPONENT}'/>")
    again = lab.next_push()
    assert body_of(again) == b"keep me"
    lab.answer(again)
    record = wait_until(lambda: UnifiedPushDelivery.objects.first())
    assert record.outcome == "delivered" and record.attempts == 2


@pytest.mark.defaults
def test_stored_messages_survive_a_gateway_restart_and_arrive_in_order(lab):
    endpoint = lab.endpoint()
    code = lab.gateway.stop()
    assert code == 0
    for n in range(5):
        assert lab.post(endpoint, f"stored-{n}".encode()).status_code == 201
    lab.start_gateway()
    pushes = lab.pushes(5)
    assert [body_of(p) for p in pushes] == [f"stored-{n}".encode() for n in range(5)]
    for push in pushes:
        lab.answer(push)
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="delivered").count() == 5)
    assert not UnifiedPushMessage.objects.exists()
    holds_for(lambda: len(lab.all_pushes()) == 5, 0.5, "each sent once")


def test_a_link_that_drops_loses_nothing(lab):
    endpoint = lab.endpoint()
    lab.post(endpoint, b"in flight")
    lab.next_push()  # sent, never answered: the link drops
    lab.server.drop_connection()
    lab.server.wait_connected(count=lab.server.connections + 1, gateway=lab.gateway)
    again = lab.server.wait_for(lambda s: s.find(PUSH) is not None, count=2, timeout=15)[1]
    assert body_of(again) == b"in flight"
    lab.answer(again)
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="delivered").exists())


def test_app_component_keeps_its_p2_commands_beside_unifiedpush(lab):
    app = App.objects.create(tenant=lab.component.tenant, name="conversations")
    Component.objects.filter(pk=lab.component.pk).update(app=app)
    lab.server.wait_connected(count=lab.server.connections + 1, gateway=lab.gateway)  # reconnected
    info = lab.iq("<query xmlns='http://jabber.org/protocol/disco#info'/>", iq_type="get")
    features = {f.get("var") for f in info.iter("{http://jabber.org/protocol/disco#info}feature")}
    assert {UP_NS, "http://jabber.org/protocol/commands", "urn:xmpp:push:0"} <= features
