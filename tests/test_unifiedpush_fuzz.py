"""Hostile input against the push resource, message resources and the Matrix gateway: token
shapes, methods, headers and bodies from hypothesis. Never a 500, only the statuses the
contract names, and a well-formed POST to a live endpoint is always stored. The resource is
called as the web server calls it (tests/support/push_client.py)."""

from __future__ import annotations

import base64
import json
import os
import time
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.models import Tenant
from relay.unifiedpush.models import UnifiedPushMessage
from relay.unifiedpush.services import keys, messages, registration, tokens
from tests.support.unifiedpush_components import serving_unifiedpush

pytestmark = [pytest.mark.django_db, pytest.mark.defaults]

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ALLOWED = {200, 201, 204, 400, 404, 405, 411, 413, 429, 503}
URLSAFE = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


@pytest.fixture
def endpoints(db):
    messages.reset_limits()
    tenant = Tenant.objects.create(name="fuzz")
    component = serving_unifiedpush(
        tenant=tenant,
        jid="up.fuzz.example",
        secret="x",
        endpoint_url="https://push.fuzz.example",
    )

    def token(now: float | None = None) -> str:
        registered = registration.register(
            component_id=component.pk,
            jid="fuzz@fuzz.example/phone",
            domain="fuzz.example",
            has_resource=True,
            application=base64.b64encode(os.urandom(32)).decode(),
            instance=base64.b64encode(os.urandom(32)).decode(),
            now=now or time.time(),
        )
        return registered.endpoint.rsplit("/", 1)[1]

    foreign = keys.KeyRing((keys._make_key(os.urandom(32)),))
    foreign_token, _ = tokens.issue(
        jid="fuzz@fuzz.example/phone",
        application=os.urandom(32),
        instance=os.urandom(32),
        component_id=component.pk,
        expires=int(time.time()) + 3600,
        ring=foreign,
    )
    return {
        "live": token(),
        "expired": token(now=time.time() - 30 * 86400),
        "foreign": foreign_token,
    }


@st.composite
def token_shapes(draw, live: str, others: list[str]) -> str:
    kind = draw(
        st.sampled_from(["live"] * 6 + ["other", "flip", "cut", "extend", "random", "text"])
    )
    if kind == "live":
        return live
    if kind == "other":
        return draw(st.sampled_from(others))
    if kind == "flip":
        index = draw(st.integers(0, len(live) - 1))
        return live[:index] + draw(st.sampled_from(URLSAFE + ".")) + live[index + 1 :]
    if kind == "cut":
        return live[: draw(st.integers(0, len(live) - 1))]
    if kind == "extend":
        return live + draw(st.text(URLSAFE + ".", min_size=1, max_size=50))
    if kind == "random":
        return (
            "v4.local."
            + draw(st.text(URLSAFE, min_size=0, max_size=1200))
            + "."
            + draw(st.text(URLSAFE, max_size=20))
        )
    return draw(st.text(min_size=1, max_size=300))


HEADER_TEXT = st.one_of(
    st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=40),
    st.integers(-(10**20), 10**20).map(str),
    st.sampled_from(["", "0", "60", "86400", "very-low", "low", "normal", "high", "inbox"]),
)


REACHED: set[int] = set()


@settings(FUZZ, max_examples=300, derandomize=True)  # the same examples every run
@given(data=st.data())
def hostile_push_resource_examples(push_client, endpoints, data):
    token = data.draw(token_shapes(endpoints["live"], [endpoints["expired"], endpoints["foreign"]]))
    method = data.draw(
        st.sampled_from(
            ["post", "post", "post", "get", "delete", "put", "head", "options", "patch"]
        )
    )
    headers = data.draw(
        st.dictionaries(
            st.sampled_from(
                [
                    "TTL",
                    "Topic",
                    "Urgency",
                    "Content-Encoding",
                    "Content-Type",
                    "X-Anything",
                    "Transfer-Encoding",
                ]
            ),
            HEADER_TEXT,
            max_size=5,
        )
    )
    body = data.draw(
        st.one_of(
            st.binary(max_size=300),
            st.integers(4090, 4200).map(lambda size: os.urandom(size)),
            st.binary(min_size=4000, max_size=6000),
        )
    )
    messages.reset_limits()
    response = push_client.generic(
        method.upper(),
        "/push/" + quote(token, safe=""),
        data=body,
        content_type="application/octet-stream",
        headers=headers,
    )
    status, content = response.status_code, response.content
    assert status in ALLOWED, (status, content[:200])
    REACHED.add(status)
    well_formed = (
        token == endpoints["live"]
        and method == "post"
        and len(body) <= 4096
        and "Transfer-Encoding" not in headers
        and headers.get("TTL", "1").isdigit()
        and len(headers.get("TTL", "1")) <= 12
        and all(c in URLSAFE for c in headers.get("Topic", "a"))
        and len(headers.get("Topic", "")) <= 32
        and headers.get("Urgency", "low").strip().lower()
        in {"very-low", "low", "normal", "high", ""}
    )
    if well_formed:
        assert status == 201, content
    if token != endpoints["live"]:
        assert status in {400, 404, 405, 411, 413}


def test_the_push_resource_never_fails_on_hostile_input(push_client, endpoints):
    REACHED.clear()
    hostile_push_resource_examples(push_client, endpoints)
    # The examples got past every check at least once, storing included.
    assert {201, 400, 404, 405, 413} <= REACHED, REACHED


@FUZZ
@given(
    reference=st.one_of(st.text(max_size=60), st.text(URLSAFE + ".", max_size=60)),
    method=st.sampled_from(["delete", "get", "post"]),
)
def test_message_resources_never_fail(push_client, endpoints, reference, method):
    response = push_client.generic(method.upper(), "/push/message/" + quote(reference, safe=""))
    assert response.status_code in ALLOWED


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)


@FUZZ
@given(data=st.data())
def test_the_matrix_gateway_never_fails(push_client, endpoints, data):
    shape = data.draw(st.sampled_from(["json", "bytes", "notification"]))
    if shape == "bytes":
        payload = data.draw(st.binary(max_size=3000))
    elif shape == "json":
        payload = json.dumps(data.draw(JSON)).encode()
    else:
        pushkey = data.draw(
            st.one_of(
                st.just("https://push.fuzz.example/push/" + endpoints["live"]),
                st.just("https://push.fuzz.example/push/" + endpoints["expired"]),
                st.text(max_size=200),
                st.integers(),
                st.none(),
            )
        )
        notification = {
            "notification": {
                "event_id": data.draw(st.text(max_size=20)),
                "content": data.draw(JSON),
                "prio": data.draw(st.sampled_from(["high", "low", 3, None])),
                "devices": data.draw(
                    st.one_of(
                        st.just([{"pushkey": pushkey, "app_id": "x"}]),
                        st.lists(
                            st.dictionaries(st.sampled_from(["pushkey", "app_id", "data"]), JSON),
                            max_size=3,
                        ),
                        JSON,
                    )
                ),
            }
        }
        payload = json.dumps(notification).encode()
    messages.reset_limits()
    response = push_client.post(
        "/_matrix/push/v1/notify", data=payload, content_type="application/json"
    )
    assert response.status_code in {200, 400, 413, 429, 503}
    if response.status_code == 200:
        assert isinstance(response.json()["rejected"], list)


def test_the_fuzz_stored_what_it_accepted_and_nothing_else(push_client, endpoints):
    """A control: the same client and fixture do store a well-formed POST."""
    response = push_client.post(
        "/push/" + endpoints["live"], data=b"x", content_type="application/octet-stream"
    )
    assert response.status_code == 201
    assert UnifiedPushMessage.objects.count() == 1
