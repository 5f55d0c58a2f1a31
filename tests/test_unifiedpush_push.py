"""The push resource in the web process: POST, GET, DELETE, on the real database.

What the gateway does with stored messages is in test_unifiedpush_e2e.py; here the web
process's answers and what it leaves in the database.
"""

from __future__ import annotations

import base64
import json
import os
import time
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from relay.models import Component, Tenant
from relay.unifiedpush.models import UnifiedPushDelivery, UnifiedPushMessage, UnifiedPushRevocation
from relay.unifiedpush.services import messages, registration, store
from tests.support.unifiedpush_components import serving_unifiedpush

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]

JID = "juliet@example.com/Conversations.r4nD"
BASE = "https://push.example.org"


@pytest.fixture(autouse=True)
def fresh_limits():
    messages.reset_limits()
    yield
    messages.reset_limits()


@pytest.fixture
def up_component(db):
    tenant = Tenant.objects.create(name="up")
    return serving_unifiedpush(
        tenant=tenant, jid="up.example.org", secret="s3cr3t", endpoint_url=BASE
    )


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def register(component, jid=JID, *, now=None):
    return registration.register(
        component_id=component.pk,
        jid=jid,
        domain=jid.split("@")[1].split("/")[0],
        has_resource=True,
        application=b64(os.urandom(32)),
        instance=b64(os.urandom(32)),
        now=now or time.time(),
    )


def path_of(url: str) -> str:
    return urlsplit(url).path


def post(push_client, endpoint, body=b"hello", **headers):
    return push_client.post(
        path_of(endpoint), data=body, content_type="application/octet-stream", headers=headers
    )


def test_a_post_is_stored_sealed_and_answered_201(push_client, up_component):
    endpoint = register(up_component).endpoint
    assert endpoint.startswith(BASE + "/push/v4.local.") and len(endpoint) <= 1000
    response = post(push_client, endpoint, b"secret body", TTL="3600", Urgency="high")
    assert response.status_code == 201, response.content
    assert response["TTL"] == "3600"
    assert response["Location"].startswith(BASE + "/push/message/")
    row = UnifiedPushMessage.objects.get()
    assert row.size == len(b"secret body") and row.ttl == 3600 and row.urgency == 3
    assert abs((row.expires - row.received).total_seconds() - 3600) < 1
    dump = repr(list(UnifiedPushMessage.objects.values())).encode() + bytes(row.sealed)
    for clear in (b"juliet", b"example.com", b"secret body", b"Conversations"):
        assert clear not in dump
    opened = messages.open_message(bytes(row.sealed))
    assert opened.jid == JID and opened.body == b"secret body"


def test_get_on_an_endpoint_is_discovery(push_client, up_component):
    endpoint = register(up_component).endpoint
    response = push_client.get(path_of(endpoint))
    assert response.status_code == 200
    assert response.json() == {"unifiedpush": {"version": 1}}
    assert push_client.get("/push/v4.local.nonsense").status_code == 404


def test_4096_bytes_are_accepted_and_4097_are_413(push_client, up_component):
    endpoint = register(up_component).endpoint
    assert post(push_client, endpoint, os.urandom(4096)).status_code == 201
    too_big = post(push_client, endpoint, os.urandom(4097))
    assert too_big.status_code == 413
    assert post(push_client, endpoint, b"x").status_code == 201
    assert post(push_client, endpoint, b"").status_code == 201  # RFC 8030: never refuse less
    assert sorted(UnifiedPushMessage.objects.values_list("size", flat=True)) == [0, 1, 4096]


def test_a_tampered_truncated_or_unknown_token_is_404(push_client, up_component):
    endpoint = register(up_component).endpoint
    token = endpoint.rsplit("/", 1)[1]
    middle = len(token) // 2
    tampered = token[:middle] + ("A" if token[middle] != "A" else "B") + token[middle + 1 :]
    for bad in (tampered, token[:-5], token[:60], "v4.local.x.y", "x" * 900):
        assert (
            push_client.post("/push/" + bad, data=b"x", content_type="text/plain").status_code
            == 404
        )
    assert not UnifiedPushMessage.objects.exists()


def test_an_expired_endpoint_is_404(push_client, up_component):
    endpoint = register(up_component, now=time.time() - 8 * 86400).endpoint
    assert post(push_client, endpoint).status_code == 404


def test_a_disabled_component_or_one_without_unifiedpush_is_404(push_client, up_component):
    endpoint = register(up_component).endpoint
    Component.objects.filter(pk=up_component.pk).update(enabled=False)
    messages.reset_limits()  # the policy cache
    assert post(push_client, endpoint).status_code == 404


@pytest.mark.parametrize(
    "headers",
    [
        {"TTL": "-1"},
        {"TTL": "soon"},
        {"TTL": "1.5"},
        {"Topic": "a" * 33},
        {"Topic": "a b"},
        {"Topic": "ä"},
        {"Urgency": "urgent"},
    ],
)
def test_malformed_headers_are_400(push_client, up_component, headers):
    endpoint = register(up_component).endpoint
    assert post(push_client, endpoint, **headers).status_code == 400


def test_the_ttl_is_capped_and_defaulted(push_client, up_component):
    endpoint = register(up_component).endpoint
    with override_settings(
        RELAY={
            **settings.RELAY,
            "UNIFIEDPUSH_MAX_TTL_SECONDS": 600,
            "UNIFIEDPUSH_DEFAULT_TTL_SECONDS": 300,
        }
    ):
        assert post(push_client, endpoint, TTL="86400")["TTL"] == "600"
        assert post(push_client, endpoint)["TTL"] == "300"
        assert post(push_client, endpoint, TTL="0")["TTL"] == "0"
        # RFC 8030's TTL is 1*DIGIT: any number of digits is a TTL, capped like the others.
        assert post(push_client, endpoint, TTL="9" * 20)["TTL"] == "600"
        assert post(push_client, endpoint, TTL="9" * 5000)["TTL"] == "600"
        assert post(push_client, endpoint, TTL="0" * 30 + "42")["TTL"] == "42"


def test_a_newer_message_with_the_same_topic_replaces_the_stored_one(push_client, up_component):
    endpoint = register(up_component).endpoint
    post(push_client, endpoint, b"first", Topic="inbox")
    post(push_client, endpoint, b"other", Topic="calls")
    post(push_client, endpoint, b"untopical")
    post(push_client, endpoint, b"second", Topic="inbox")
    bodies = [
        messages.open_message(bytes(row.sealed)).body
        for row in UnifiedPushMessage.objects.order_by("id")
    ]
    assert bodies == [b"other", b"untopical", b"second"]
    record = UnifiedPushDelivery.objects.get()
    assert record.outcome == "replaced" and record.size == len(b"first")


def test_topics_of_another_endpoint_are_left_alone(push_client, up_component):
    one, two = register(up_component).endpoint, register(up_component).endpoint
    post(push_client, one, b"a", Topic="inbox")
    post(push_client, two, b"b", Topic="inbox")
    assert UnifiedPushMessage.objects.count() == 2


def test_storage_per_endpoint_is_bounded_and_the_least_urgent_oldest_goes(
    push_client, up_component
):
    endpoint = register(up_component).endpoint
    with override_settings(RELAY={**settings.RELAY, "UNIFIEDPUSH_MAX_STORED_PER_ENDPOINT": 3}):
        post(push_client, endpoint, b"high-1", Urgency="high")
        post(push_client, endpoint, b"low-1", Urgency="low")
        post(push_client, endpoint, b"normal-1")
        post(push_client, endpoint, b"normal-2")  # full: low-1 goes
        post(push_client, endpoint, b"normal-3")  # full: normal-1 goes
    bodies = [
        messages.open_message(bytes(row.sealed)).body
        for row in UnifiedPushMessage.objects.order_by("id")
    ]
    assert bodies == [b"high-1", b"normal-2", b"normal-3"]
    dropped = UnifiedPushDelivery.objects.filter(outcome="dropped").order_by("id")
    assert [(r.urgency, r.size) for r in dropped] == [(1, 5), (2, 8)]


def test_too_many_for_one_endpoint_is_429_with_retry_after(push_client, up_component):
    endpoint = register(up_component).endpoint
    other = register(up_component).endpoint
    with override_settings(RELAY={**settings.RELAY, "UNIFIEDPUSH_ENDPOINT_RATE": (0.5, 3)}):
        messages.reset_limits()
        answers = [post(push_client, endpoint).status_code for _ in range(4)]
        assert answers == [201, 201, 201, 429]
        refused = post(push_client, endpoint)
        assert refused.status_code == 429 and 1 <= int(refused["Retry-After"]) <= 2
        assert post(push_client, other).status_code == 201  # another endpoint is not affected
    assert UnifiedPushMessage.objects.count() == 4


def test_too_many_for_one_tenant_is_429(push_client, up_component):
    endpoints = [register(up_component).endpoint for _ in range(4)]
    Tenant.objects.filter(pk=up_component.tenant_id).update(
        rate_limit_per_second=0.1, rate_limit_burst=2
    )
    messages.reset_limits()
    answers = [post(push_client, endpoint).status_code for endpoint in endpoints]
    assert answers == [201, 201, 429, 429]
    assert int(post(push_client, endpoints[0])["Retry-After"]) >= 5


def test_a_suspended_tenant_is_503_and_keeps_its_endpoints(push_client, up_component):
    endpoint = register(up_component).endpoint
    Tenant.objects.filter(pk=up_component.tenant_id).update(suspended=True)
    messages.reset_limits()
    refused = post(push_client, endpoint)
    assert refused.status_code == 503 and refused["Retry-After"]
    Tenant.objects.filter(pk=up_component.tenant_id).update(suspended=False)
    messages.reset_limits()
    assert post(push_client, endpoint).status_code == 201


def test_delete_withdraws_a_stored_message(push_client, up_component):
    endpoint = register(up_component).endpoint
    location = post(push_client, endpoint, b"oops")["Location"]
    kept = post(push_client, endpoint, b"fine")
    assert push_client.delete(path_of(location)).status_code == 204
    assert push_client.delete(path_of(location)).status_code == 404
    assert UnifiedPushMessage.objects.count() == 1
    assert UnifiedPushDelivery.objects.get().outcome == "withdrawn"
    reference = path_of(kept["Location"]).rsplit("/", 1)[1]
    forged = reference[:-1] + ("0" if reference[-1] != "0" else "1")
    assert push_client.delete("/push/message/" + forged).status_code == 404
    assert push_client.delete("/push/message/nonsense").status_code == 404
    assert push_client.post(path_of(kept["Location"])).status_code == 405
    assert UnifiedPushMessage.objects.count() == 1


def test_a_revoked_endpoint_is_404_until_it_expires(push_client, up_component):
    endpoint = register(up_component).endpoint
    other = register(up_component).endpoint
    post(push_client, endpoint, b"before")
    row = UnifiedPushMessage.objects.get()
    ended = store.revoke(
        endpoint_key=row.endpoint_key,
        tenant_id=row.tenant_id,
        until=row.endpoint_expires,
        now=timezone.now(),
    )
    assert ended == 1 and not UnifiedPushMessage.objects.exists()
    assert post(push_client, endpoint).status_code == 404
    assert push_client.get(path_of(endpoint)).status_code == 404  # discovery says it is gone too
    assert post(push_client, other).status_code == 201
    assert push_client.get(path_of(other)).status_code == 200
    assert UnifiedPushDelivery.objects.get().outcome == "revoked"
    store.expire(now=row.endpoint_expires + timedelta(seconds=1), grace=timedelta(0))
    assert not UnifiedPushRevocation.objects.exists()


def test_expired_messages_end_as_expired(push_client, up_component):
    endpoint = register(up_component).endpoint
    post(push_client, endpoint, b"short", TTL="10")
    post(push_client, endpoint, b"long", TTL="1000")
    ended = store.expire(now=timezone.now() + timedelta(seconds=100), grace=timedelta(seconds=30))
    assert ended == 1
    assert UnifiedPushDelivery.objects.get().outcome == "expired"
    assert UnifiedPushMessage.objects.get().ttl == 1000


def test_other_methods_are_405(push_client, up_component):
    endpoint = register(up_component).endpoint
    assert push_client.generic("PUT", path_of(endpoint)).status_code == 405
    assert push_client.delete(path_of(endpoint)).status_code == 405


def test_the_system_check_names_bad_keys_and_messages_no_key_opens(push_client, up_component):
    from relay.unifiedpush.checks import unifiedpush_keys_check
    from relay.unifiedpush.services.keys import new_master_key

    with override_settings(RELAY={**settings.RELAY, "UNIFIEDPUSH_KEYS": ["tooshort"]}):
        assert [m.id for m in unifiedpush_keys_check()] == ["relay.E011"]
    old = settings.RELAY["UNIFIEDPUSH_KEYS"]
    post(push_client, register(up_component).endpoint)
    assert unifiedpush_keys_check() == []
    with override_settings(RELAY={**settings.RELAY, "UNIFIEDPUSH_KEYS": [new_master_key(), *old]}):
        assert unifiedpush_keys_check() == []  # rotating: the old key still opens it
    with override_settings(RELAY={**settings.RELAY, "UNIFIEDPUSH_KEYS": [new_master_key()]}):
        [warning] = unifiedpush_keys_check()
        assert warning.id == "relay.W030" and warning.msg.startswith("1 stored")


def matrix(push_client, devices, **notification):
    body = {
        "notification": {
            "event_id": "$e",
            "room_id": "!r",
            "prio": "high",
            **notification,
            "devices": devices,
        }
    }
    return push_client.post("/_matrix/push/v1/notify", data=body, content_type="application/json")


def test_the_matrix_gateway_trims_what_does_not_fit_and_keeps_the_event(push_client, up_component):
    endpoint = register(up_component).endpoint
    device = {"app_id": "im.app", "pushkey": endpoint, "data": {"format": "event_id_only"}}
    answer = matrix(push_client, [device], content={"body": "x" * 5000}, counts={"unread": 3})
    assert answer.status_code == 200 and answer.json() == {"rejected": []}
    body = messages.open_message(bytes(UnifiedPushMessage.objects.get().sealed)).body
    relayed = json.loads(body)["notification"]
    assert len(body) <= 4096 and "content" not in relayed
    assert relayed["event_id"] == "$e" and relayed["counts"] == {"unread": 3}
    assert relayed["devices"] == [{"app_id": "im.app", "pushkey": endpoint}]


def test_the_matrix_gateway_answers_429_when_a_device_is_over_its_limit(push_client, up_component):
    endpoint = register(up_component).endpoint
    with override_settings(RELAY={**settings.RELAY, "UNIFIEDPUSH_ENDPOINT_RATE": (0.1, 1)}):
        messages.reset_limits()
        assert matrix(push_client, [{"pushkey": endpoint}]).status_code == 200
        refused = matrix(push_client, [{"pushkey": endpoint}, {"pushkey": "https://x/push/nope"}])
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    assert refused.json()["errcode"] == "M_LIMIT_EXCEEDED"
    low = matrix(push_client, [{"pushkey": register(up_component).endpoint}], prio="low")
    assert low.status_code == 200
    assert UnifiedPushMessage.objects.order_by("-id").first().urgency == 1  # low


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b"[]",
        b'{"notification": {}}',
        b'{"notification": {"devices": []}}',
        b'{"notification": {"devices": [{"app_id": "x"}]}}',
    ],
)
def test_the_matrix_gateway_refuses_what_is_not_a_notification(push_client, payload):
    answer = push_client.post(
        "/_matrix/push/v1/notify", data=payload, content_type="application/json"
    )
    assert answer.status_code == 400


def test_an_opened_token_is_reused_but_still_expires_and_needs_its_key(push_client, up_component):
    """The web process keeps tokens it opened (relay/unifiedpush/services/messages.py): a
    cached one still expires on time, and one whose key left the list no longer opens."""
    from relay.unifiedpush.services.keys import new_master_key

    registered = register(up_component, now=time.time() - 7 * 86400 + 60)  # a minute left
    token = registered.endpoint.rsplit("/", 1)[1]
    assert post(push_client, registered.endpoint).status_code == 201
    assert token in messages._opened
    assert post(push_client, registered.endpoint).status_code == 201  # from the cache
    with pytest.raises(messages.PushRefused) as refused:
        messages.accept(token=token, body=b"x", ttl=None, topic=None, urgency=None,
                        now=time.time() + 120)  # fmt: skip
    assert refused.value.status == 404
    with override_settings(RELAY={**settings.RELAY, "UNIFIEDPUSH_KEYS": [new_master_key()]}):
        assert post(push_client, registered.endpoint).status_code == 404
    assert post(push_client, registered.endpoint).status_code == 201  # the key is back
    tampered = registered.endpoint[:-5] + (
        "AAAAA" if registered.endpoint[-5:] != "AAAAA" else "BBBBB"
    )
    assert post(push_client, tampered).status_code == 404
    assert tampered.rsplit("/", 1)[1] not in messages._opened
