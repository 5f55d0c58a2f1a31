"""UnifiedPush end to end: a real Prosody routes between our component (the gateway process)
and a slixmpp phone; the web process is `python -m pushsite.server`; application servers are
`pywebpush` (RFC 8291 encryption, VAPID) and plain HTTP clients; the phone decrypts with
`http_ece`.

The phone registers, is online, goes offline (session closed: Prosody answers our pushes
`service-unavailable`), hibernates with stream management (Prosody holds our pushes in the
session until it resumes), and comes back.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from email.message import Message

import pytest
from django.conf import settings
from django.test import override_settings
from pywebpush import webpush

from relay.models import ComponentLink, Tenant
from relay.unifiedpush.models import (
    ComponentSettings,
    UnifiedPushDelivery,
    UnifiedPushMessage,
    UnifiedPushRevocation,
)
from relay.unifiedpush.services import messages
from relay.unifiedpush.services.keys import new_master_key
from tests.support.processes import start_gateway, start_web
from tests.support.unifiedpush_components import serving_unifiedpush, set_endpoint_url
from tests.support.unifiedpush_phone import Phone
from tests.support.waiting import holds_for, wait_until
from tests.support.xmpp_client import new_username, register_account

# On the embedded defaults, the tests marked `defaults` below stand for the module: what the
# others test does not depend on the database or the broker, and each starts a gateway.
pytestmark = [pytest.mark.django_db(transaction=True)]

COMPONENT = ("up.localhost", "s3cr3t")
GATEWAY_ENV = {
    "RELAY_UNIFIEDPUSH_RETRY_BASE_SECONDS": "0.5",
    "RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS": "2",
    "RELAY_UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS": "10",
    "RELAY_UNIFIEDPUSH_SWEEP_SECONDS": "0.2",
}
VAPID_CLAIMS = {"sub": "mailto:ops@app.example"}


def vapid_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    raw = key.private_numbers().private_value.to_bytes(32, "big")
    assert key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


class Lab:
    def __init__(self, server, component, web_url) -> None:
        self.server = server
        self.component = component
        self.web_url = web_url
        self.gateway = None
        self.web = None
        self.phones: list[Phone] = []

    def start_gateway(self, **env: str) -> None:
        ComponentLink.objects.filter(component=self.component).update(state="down")
        self.gateway = start_gateway(**{**GATEWAY_ENV, **env})
        wait_until(
            lambda: ComponentLink.objects.filter(component=self.component, state="up").exists(),
            what=lambda: f"the link is up\n{self.gateway.log_tail()}",
        )

    def phone(self, **kwargs) -> Phone:
        username, password = new_username("phone"), "pw-" + os.urandom(6).hex()
        register_account(self.server, username, password)
        phone = Phone(self.server, username, password, resource="Conversations.r4nD", **kwargs)
        self.phones.append(phone)
        phone.connect()
        return phone

    def post(self, url: str, body: bytes = b"hello", **headers: str) -> tuple[int, Message]:
        """(status, headers: looked up by name in any case, as HTTP's are)."""
        request = urllib.request.Request(url, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.headers
        except urllib.error.HTTPError as error:
            return error.code, error.headers

    def delete(self, url: str) -> int:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, method="DELETE"), timeout=30
            ) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    def delivered(self) -> int:
        return UnifiedPushDelivery.objects.filter(outcome="delivered").count()


@pytest.fixture
def lab(xmpp_server_factory):
    messages.reset_limits()
    server = xmpp_server_factory("prosody", components=[COMPONENT], hibernation_time=120)
    web, web_url = start_web()
    tenant = Tenant.objects.create(name="up", allowed_domains="localhost")
    component = serving_unifiedpush(
        tenant=tenant,
        jid=COMPONENT[0],
        secret=COMPONENT[1],
        host="127.0.0.1",
        port=server.component_port,
        endpoint_url=web_url,
    )
    lab = Lab(server, component, web_url)
    lab.web = web
    lab.start_gateway()
    try:
        yield lab
    finally:
        for phone in lab.phones:
            phone.close()
        gateway_code = lab.gateway.stop()
        lab.web.stop()
        assert gateway_code == 0, lab.gateway.log_text()[-3000:]
        for log in (lab.gateway.log_text(), lab.web.log_text()):
            for phone in lab.phones:
                assert phone.bare_jid.split("@")[0] not in log, "a log names an account"
            assert "v4.local." not in log, "a log holds an endpoint token"
        # The access log, redacted.
        assert any('"POST /push/… HTTP/1.1" ' in event for event in lab.web.log_events())


@pytest.mark.defaults
def test_webpush_through_prosody_reaches_the_phone_decryptable(lab):
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    assert endpoint.url.startswith(lab.web_url + "/push/v4.local.")
    plaintext = json.dumps({"title": "New toot", "body": "ünïcödé " * 40}).encode()
    response = webpush(
        subscription_info=endpoint.keys.subscription(endpoint.url),
        data=plaintext,
        vapid_private_key=vapid_key(),
        vapid_claims=dict(VAPID_CLAIMS),
        ttl=600,
        headers={"Urgency": "high", "Topic": "timeline"},
    )
    assert response.status_code == 201, response.text
    assert response.headers["TTL"] == "600"
    [push] = phone.wait_for_pushes(1)
    assert push.sender == COMPONENT[0]
    assert (push.application, push.instance) == (endpoint.application, endpoint.instance)
    assert endpoint.keys.decrypt(push.body) == plaintext
    wait_until(lambda: lab.delivered() == 1)
    assert not UnifiedPushMessage.objects.exists()
    record = UnifiedPushDelivery.objects.get()
    assert record.urgency == 3 and record.size == len(push.body) and record.ttl == 600


@pytest.mark.defaults
def test_an_offline_phone_gets_everything_in_order_when_it_is_back(lab):
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    phone.disconnect()  # the session ends: Prosody answers our pushes service-unavailable
    for n in range(4):
        status, _ = lab.post(endpoint.url, f"message {n}".encode())
        assert status == 201
    wait_until(lambda: UnifiedPushMessage.objects.filter(attempts__gte=1).exists())
    holds_for(lambda: phone.pushes_now() == [], 1, "nothing reaches an offline phone")
    phone.connect()
    phone.announce(COMPONENT[0])
    pushes = phone.wait_for_pushes(4)
    assert [p.body for p in pushes] == [f"message {n}".encode() for n in range(4)]
    wait_until(lambda: lab.delivered() == 4)
    assert not UnifiedPushMessage.objects.exists()
    holds_for(lambda: len(phone.pushes_now()) == 4, 1, "each arrives exactly once")


def test_a_hibernated_phone_gets_its_push_when_the_session_resumes(lab):
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    phone.abort()  # TCP gone, session hibernated by XEP-0198
    status, _ = lab.post(endpoint.url, b"while asleep")
    assert status == 201
    holds_for(
        lambda: phone.pushes_now() == [] and UnifiedPushMessage.objects.count() == 1,
        1.5,
        "kept while the phone sleeps",
    )
    assert phone.connect() == "resumed"
    [push] = phone.wait_for_pushes(1)
    assert push.body == b"while asleep"
    wait_until(lambda: lab.delivered() == 1)
    holds_for(lambda: len(phone.pushes_now()) == 1, 1, "it arrives once")


def test_a_hibernation_longer_than_the_answer_timeout_still_delivers_once(lab):
    lab.gateway.stop()
    lab.start_gateway(
        RELAY_UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS="1", RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS="30"
    )
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    phone.abort()
    lab.post(endpoint.url, b"long sleep")
    # Counted as a failed attempt once its answer timed out: the hibernation is longer.
    wait_until(lambda: UnifiedPushMessage.objects.filter(attempts=1).exists())
    assert phone.connect() == "resumed"
    [push] = phone.wait_for_pushes(1)
    assert push.body == b"long sleep"
    wait_until(lambda: lab.delivered() == 1)  # the late result counts
    holds_for(lambda: len(phone.pushes_now()) == 1, 1.5, "it arrives once")


def test_an_uninstalled_app_revokes_its_endpoint(lab):
    phone = lab.phone()
    gone, kept = phone.register_endpoint(COMPONENT[0]), phone.register_endpoint(COMPONENT[0])
    phone.answer_with = "item-not-found"
    # Online, the POST waits for the phone's answer (the direct path): refused, so 404 at once.
    assert lab.post(gone.url, b"to a removed app")[0] == 404
    phone.wait_for_pushes(1)
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="revoked").exists())
    assert UnifiedPushRevocation.objects.count() == 1
    assert lab.post(gone.url, b"again")[0] == 404
    assert len(phone.pushes_now()) == 1  # the revoked endpoint's POST never reached the phone
    phone.answer_with = "result"
    assert lab.post(kept.url, b"still fine")[0] == 201
    assert phone.wait_for_pushes(2)[1].body == b"still fine"


def test_ttl_topic_and_delete_while_the_phone_is_offline(lab):
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    phone.disconnect()
    assert lab.post(endpoint.url, b"expires", TTL="1")[0] == 201
    assert lab.post(endpoint.url, b"inbox v1", Topic="inbox")[0] == 201
    status, headers = lab.post(endpoint.url, b"withdrawn")
    assert status == 201
    assert lab.post(endpoint.url, b"inbox v2", Topic="inbox")[0] == 201
    assert lab.delete(headers["Location"]) == 204
    assert lab.post(endpoint.url, b"kept")[0] == 201
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="expired").exists())
    phone.connect()
    phone.announce(COMPONENT[0])
    pushes = phone.wait_for_pushes(2)
    holds_for(
        lambda: [p.body for p in phone.pushes_now()] == [b"inbox v2", b"kept"],
        1,
        "only the latest of a topic and what was kept arrive",
    )
    assert [p.body for p in pushes] == [b"inbox v2", b"kept"]
    outcomes = sorted(UnifiedPushDelivery.objects.values_list("outcome", flat=True))
    wait_until(lambda: lab.delivered() == 2)
    assert sorted(UnifiedPushDelivery.objects.values_list("outcome", flat=True)) == [
        "delivered",
        "delivered",
        "expired",
        "replaced",
        "withdrawn",
    ]
    assert "withdrawn" in outcomes


def test_a_gateway_restart_while_messages_are_stored_loses_nothing(lab):
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    assert lab.gateway.stop() == 0
    for n in range(3):
        assert lab.post(endpoint.url, f"stored {n}".encode())[0] == 201
    lab.start_gateway()
    pushes = phone.wait_for_pushes(3)
    assert [p.body for p in pushes] == [f"stored {n}".encode() for n in range(3)]
    wait_until(lambda: lab.delivered() == 3)


def test_4096_bytes_over_http_and_4097_refused(lab):
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    big = os.urandom(4096)
    assert lab.post(endpoint.url, big)[0] == 201
    assert lab.post(endpoint.url, big + b"x")[0] == 413
    assert phone.wait_for_pushes(1)[0].body == big
    holds_for(lambda: len(phone.pushes_now()) == 1, 0.5, "the refused one never arrives")


def test_key_rotation_keeps_old_endpoints_until_the_old_key_goes(lab):
    old_key, new_key = new_master_key(), new_master_key()
    keyring_env = {"UNIFIEDPUSH_KEYS": old_key}

    def restart(keys: str) -> None:
        lab.gateway.stop()
        lab.web.stop()
        lab.web, url = start_web(UNIFIEDPUSH_KEYS=keys)
        set_endpoint_url(lab.component, url)
        lab.start_gateway(UNIFIEDPUSH_KEYS=keys)

    restart(keyring_env["UNIFIEDPUSH_KEYS"])
    phone = lab.phone()
    old = phone.register_endpoint(COMPONENT[0])
    restart(f"{new_key},{old_key}")
    base = ComponentSettings.objects.get(component=lab.component).endpoint_url
    old_url = base + "/push/" + old.url.rsplit("/push/", 1)[1]
    assert lab.post(old_url, b"old endpoint, rotated keys")[0] == 201
    assert phone.wait_for_pushes(1)[0].body == b"old endpoint, rotated keys"
    # Its answer recorded before the next restart (else it is sent again: at least once).
    wait_until(lambda: lab.delivered() == 1)
    new = phone.register_endpoint(COMPONENT[0])
    assert new.url.rsplit(".", 1)[1] != old.url.rsplit(".", 1)[1]  # another kid
    restart(new_key)
    base = ComponentSettings.objects.get(component=lab.component).endpoint_url
    assert lab.post(base + "/push/" + old.url.rsplit("/push/", 1)[1])[0] == 404
    assert lab.post(new.url.replace(new.url.split("/push/")[0], base), b"new")[0] == 201
    assert phone.wait_for_pushes(2)[1].body == b"new"
    with override_settings(RELAY={**settings.RELAY, "UNIFIEDPUSH_KEYS": [new_key]}):
        wait_until(lambda: lab.delivered() == 2)


@pytest.mark.defaults
def test_the_matrix_gateway_relays_and_rejects(lab):
    phone = lab.phone()
    live = phone.register_endpoint(COMPONENT[0])
    revoked = phone.register_endpoint(COMPONENT[0])
    phone.answer_with = "item-not-found"
    lab.post(revoked.url, b"uninstall")
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="revoked").exists())
    phone.answer_with = "result"
    token = live.url.rsplit("/", 1)[1]
    tampered = live.url[:-12] + ("A" if live.url[-12] != "A" else "B") + live.url[-11:]
    devices = [
        {"app_id": "im.vector.app", "pushkey": url, "pushkey_ts": 1, "data": {}}
        for url in (
            live.url,
            tampered,
            revoked.url,
            lab.web_url + "/push/" + token[:40],
            "https://elsewhere.example/not-an-endpoint",
        )
    ]
    notification = {
        "notification": {
            "event_id": "$ev:matrix.example",
            "room_id": "!room:matrix.example",
            "type": "m.room.message",
            "prio": "high",
            "counts": {"unread": 2},
            "devices": devices,
        }
    }
    request = urllib.request.Request(
        lab.web_url + "/_matrix/push/v1/notify",
        data=json.dumps(notification).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
    assert sorted(answer["rejected"]) == sorted(d["pushkey"] for d in devices[1:])
    pushes = phone.wait_for_pushes(2)
    relayed = json.loads(pushes[1].body)
    assert relayed["notification"]["event_id"] == "$ev:matrix.example"
    assert relayed["notification"]["devices"] == [devices[0]]
    # Counted like a POST: its delivery record is what the reports' UnifiedPush source reads.
    wait_until(lambda: lab.delivered() == 1)
    record = UnifiedPushDelivery.objects.get(outcome="delivered")
    assert record.size == len(pushes[1].body) and record.component_id == lab.component.id
    discovery = json.loads(urllib.request.urlopen(lab.web_url + "/_matrix/push/v1/notify").read())
    assert discovery == {"unifiedpush": {"gateway": "matrix"}}
