"""The Windows API's fast WSGI path (relay.windows.api.fast) answers exactly as the ninja views do.

Each request goes through pushsite.wsgi's application (fast path in front of Django) and the
same request through Django alone; status, body and the headers that matter must agree.
"""

from __future__ import annotations

import io
import json
import uuid
from contextlib import contextmanager

import pytest
from django.core import signals
from django.core.handlers.wsgi import WSGIHandler
from django.db import close_old_connections

from relay.models import App, Registration, WnsDevice
from relay.windows.api.fast import FastUwpxPath

DEVICE_ID = "5486bd868050a620141f4e81c9f1d2c67ab0de27e5e26d218ca41c9394ee806b"
OTHER_DEVICE = "0123456789abcdef" * 4
CHANNEL = "https://db5p.notify.windows.com/?token=AwYAAAD8sXKQxmVlUmNhQ%2bjNMKn6"


@pytest.fixture(autouse=True)
def own_rate_limit_counters(settings):
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "LOCATION": f"uwpx-fast-{uuid.uuid4()}",
        }
    }


@pytest.fixture
def app(component) -> App:
    return component.app


@contextmanager
def _inside_test_transaction():
    """As Django's test client does: a request must not close the test's connection."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


def call(
    application, path: str, body: bytes, *, host: str = "127.0.0.1", address: str = "192.0.2.9"
):
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": host,
        "REMOTE_ADDR": address,
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        "wsgi.version": (1, 0),
    }
    answer: dict = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        answer["status"] = int(status.split()[0])
        answer["headers"] = {name.lower(): value for name, value in headers}

    with _inside_test_transaction():
        chunks = application(environ, start_response)
        try:
            answer["body"] = b"".join(chunks)
        finally:
            if hasattr(chunks, "close"):
                chunks.close()
    return answer


def _never(environ, start_response):
    raise AssertionError("handed on to Django")


@pytest.fixture
def paths():
    django_only = WSGIHandler()
    return FastUwpxPath(django_only), django_only


def url(app: App, action: str = "") -> str:
    return f"/api/v1/apps/{app.public_key}/uwpx" + (f"/{action}" if action else "")


def message(action: str, device_id: str = DEVICE_ID, **fields) -> bytes:
    return json.dumps({"version": 1, "action": action, "device_id": device_id, **fields}).encode()


def same(fast: dict, slow: dict) -> None:
    assert fast["status"] == slow["status"], (fast, slow)
    assert json.loads(fast["body"]) == json.loads(slow["body"])
    assert fast["headers"]["content-type"] == slow["headers"]["content-type"]
    assert fast["headers"].get("retry-after") == slow["headers"].get("retry-after")
    assert int(fast["headers"]["content-length"]) == len(fast["body"])


@pytest.mark.defaults
def test_registration_answers_alike(app, paths):
    fast, slow = paths
    channel = message("set_channel_uri", channel_uri=CHANNEL)
    same(call(fast, url(app), channel), call(slow, url(app), channel))
    assert WnsDevice.objects.count() == 1
    accounts = message("set_accounts", accounts=[{"bare_jid": "a@example.org"}])
    first = call(FastUwpxPath(_never), url(app), accounts)  # the fast path answers it alone
    assert first["status"] == 200
    # Sent again, by either path: the same node and secret, the same answer.
    same(call(fast, url(app), accounts), first)
    same(call(slow, url(app), accounts), first)
    same(call(fast, url(app, "set_accounts"), accounts), first)
    assert Registration.objects.count() == 1
    body = json.loads(first["body"])
    assert body["accounts"][0]["bare_jid"] == "a@example.org"


@pytest.mark.defaults
@pytest.mark.parametrize(
    ("action", "body"),
    [
        ("", b"{garbage"),
        ("", b"[]"),
        ("", message("set_channel_uri", channel_uri=1)),
        ("", message("no_such_action")),
        ("set_accounts", message("set_channel_uri", channel_uri=CHANNEL)),
        ("", message("set_channel_uri", channel_uri="https://evil.example/")),
        ("", message("set_accounts", device_id=OTHER_DEVICE, accounts=[])),
        ("", message("request_test_push")),
    ],
)
def test_refusals_answer_alike(app, paths, action, body):
    fast, slow = paths
    same(call(fast, url(app, action), body), call(slow, url(app, action), body))


@pytest.mark.defaults
def test_unknown_app_and_unknown_url(app, paths):
    fast, slow = paths
    body = message("set_channel_uri", channel_uri=CHANNEL)
    same(call(fast, "/api/v1/apps/nope/uwpx", body), call(slow, "/api/v1/apps/nope/uwpx", body))
    other = url(app, "set_something")
    assert call(fast, other, body)["status"] == call(slow, other, body)["status"] == 404


@pytest.mark.defaults
def test_a_host_django_refuses_is_refused(app, paths):
    fast, _ = paths
    body = message("set_channel_uri", channel_uri=CHANNEL)
    assert call(fast, url(app), body, host="evil.example")["status"] == 400
    assert not WnsDevice.objects.exists()


@pytest.mark.defaults
def test_address_limit_counts_each_request_once(app, paths, settings):
    fast, _ = paths
    settings.RELAY = settings.RELAY | {"UWPX_RATE_LIMIT_ADDRESS": (2, 60)}
    # Refused by the schema: handed on to Django, which must not count the address again.
    assert call(fast, url(app), message("set_channel_uri", channel_uri=1))["status"] == 422
    assert call(fast, url(app), message("set_channel_uri", channel_uri=CHANNEL))["status"] == 200
    limited = call(fast, url(app), b"{garbage")
    assert limited["status"] == 429
    assert 1 <= int(limited["headers"]["retry-after"]) <= 60
    assert call(fast, url(app), b"{}", address="192.0.2.10")["status"] == 422
