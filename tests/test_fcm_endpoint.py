"""The private names of firebase-admin and google-auth that relay/providers/fcm_endpoint.py relies
on, checked against the installed libraries through their public entry points (`messaging.send`,
`Credentials.before_request`) and the fake FCM.

Each test fails when a library stops using a name the way the adapter assumes: then the adapter
needs a look before the upgrade. No database, no Django.
"""

from __future__ import annotations

import secrets
import socket
import threading
import uuid
from collections.abc import Iterator

import firebase_admin
import pytest
import requests.adapters
from firebase_admin import credentials, exceptions, messaging
from google.auth.transport.requests import Request as GoogleAuthRequest

from relay.providers import fcm_endpoint
from tests.fakes.fcm import FakeFcm

PROJECT = "test-project"
GOOGLE_SEND_URL = fcm_endpoint.send_url(fcm_endpoint.GOOGLE_FCM_ENDPOINT, PROJECT)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeFcm]:
    with FakeFcm() as server:
        yield server


@pytest.fixture
def certificate(fake) -> credentials.Certificate:
    return credentials.Certificate(fake.service_account(PROJECT))


@pytest.fixture
def app(certificate) -> Iterator[firebase_admin.App]:
    app = firebase_admin.initialize_app(
        certificate,
        options={"httpTimeout": 5, "projectId": PROJECT},
        name=f"endpoint-test-{uuid.uuid4().hex}",
    )
    # Not the subject here (see the boundary tests), and it would call Google in a thread.
    certificate.get_credential()._is_regional_access_boundary_lookup_required = lambda: False
    yield app
    firebase_admin.delete_app(app)


def message(token: str) -> messaging.Message:
    wakeup = messaging.Message(data={"account": "a" * 40})
    wakeup.token = token
    return wakeup


def test_send_posts_to_the_services_fcm_url(fake, app):
    """`_get_messaging_service(app)` is the one service per App that `messaging.send` uses,
    and `_fcm_url`, set by its constructor from FCM_URL, is where it posts."""
    service = messaging._get_messaging_service(app)
    assert service is messaging._get_messaging_service(app)
    assert service._fcm_url == messaging._MessagingService.FCM_URL.format(PROJECT)
    token = "fcm-" + secrets.token_urlsafe(20)

    service._fcm_url = fcm_endpoint.send_url(fake.url, PROJECT)
    messaging.send(message(token), app=app)

    assert [r.token for r in fake.requests_for(token)] == [token]


def test_send_goes_through_the_services_client_session(fake, app):
    """`_client.session` is the session `messaging.send` uses: a transport mounted on it
    replaces the library's retries (5 attempts at a 503, with backoff)."""
    service = messaging._get_messaging_service(app)
    service._fcm_url = fcm_endpoint.send_url(fake.url, PROJECT)
    service._client.session.mount(fake.url + "/", requests.adapters.HTTPAdapter(max_retries=0))
    token = "fcm-" + secrets.token_urlsafe(20)
    fake.respond(token, status=503)

    with pytest.raises(exceptions.UnavailableError):
        messaging.send(message(token), app=app)

    assert len(fake.requests_for(token)) == 1


def test_the_adapter_points_sends_at_the_endpoint(fake, app, certificate):
    token = "fcm-" + secrets.token_urlsafe(20)
    fake.respond(token, status=500)

    url = fcm_endpoint.point_at(app, certificate.get_credential(), fake.url)
    with pytest.raises(exceptions.InternalError):
        messaging.send(message(token), app=app)

    assert url == fcm_endpoint.send_url(fake.url, PROJECT)
    assert len(fake.requests_for(token)) == 1


# --- google-auth's regional access boundary lookup


class SilentProxy:
    """An HTTPS proxy that takes CONNECT requests and holds them unanswered until `close()`:
    a lookup started through it stays in flight, so its thread can be seen."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests: list[str] = []
        self._held: list[socket.socket] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            line = conn.makefile("rb").readline().decode("latin-1").strip()
            with self._cond:
                self._held.append(conn)
                self.requests.append(line)
                self._cond.notify_all()

    def wait_for_request(self, timeout: float = 5.0) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: self.requests, timeout):
                raise AssertionError("no request reached the proxy")
            return self.requests[0]

    def close(self) -> None:
        """Refuse what is held: a lookup in flight fails and its thread ends."""
        self._listener.close()
        with self._cond:
            held, self._held = self._held, []
        for conn in held:
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            conn.close()


@pytest.fixture
def proxy(monkeypatch) -> Iterator[SilentProxy]:
    proxy = SilentProxy()
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield proxy
    proxy.close()


def new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before]


def test_google_auth_looks_the_boundary_up_at_google(proxy, certificate):
    """Why the adapter turns the lookup off for other endpoints: authorizing a request makes
    google-auth call iamcredentials.googleapis.com, with the access token, in a thread."""
    credential = certificate.get_credential()

    credential.before_request(GoogleAuthRequest(), "POST", GOOGLE_SEND_URL, {})

    assert proxy.wait_for_request().startswith("CONNECT iamcredentials.googleapis.com:443 ")


def test_the_lookup_asks_is_regional_access_boundary_lookup_required(proxy, certificate):
    credential = certificate.get_credential()
    credential._is_regional_access_boundary_lookup_required = lambda: False
    before = set(threading.enumerate())

    credential.before_request(GoogleAuthRequest(), "POST", GOOGLE_SEND_URL, {})

    # A lookup would be a thread held at the proxy now.
    assert new_threads(before) == []
    assert credential.valid and proxy.requests == []


@pytest.mark.parametrize(("endpoint", "looks_up"), [("fake", False), ("google", True)])
def test_the_adapter_leaves_the_lookup_to_google_only(fake, proxy, endpoint, looks_up):
    certificate = credentials.Certificate(fake.service_account(PROJECT))
    app = firebase_admin.initialize_app(
        certificate, options={"projectId": PROJECT}, name=f"endpoint-test-{uuid.uuid4().hex}"
    )
    try:
        credential = certificate.get_credential()
        target = fake.url if endpoint == "fake" else fcm_endpoint.GOOGLE_FCM_ENDPOINT
        url = fcm_endpoint.point_at(app, credential, target)
        before = set(threading.enumerate())
        credential.before_request(GoogleAuthRequest(), "POST", url, {})
        if looks_up:
            assert proxy.wait_for_request().startswith("CONNECT iamcredentials.googleapis.com")
        else:
            assert new_threads(before) == [] and proxy.requests == []
    finally:
        firebase_admin.delete_app(app)
