"""The FCM provider against a fake FCM: its own HTTP v1 requests (urllib3 for a lone wake-up,
aiohttp for a batch), authorized by the real firebase-admin credential and google-auth's token
grant.

No database is touched (nothing is marked django_db). Django is set up here only because
relay.models (Outcome) needs the app registry, so the module also runs without pytest-django.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
import django
from django.apps import apps

if not apps.ready:
    django.setup()

import firebase_admin
from django.conf import settings
from firebase_admin import credentials, messaging
from google.auth.transport.requests import Request as GoogleAuthRequest

from relay.providers.base import Outcome, PushProvider, SendResult, Wakeup
from relay.providers.fcm import GOOGLE_FCM_ENDPOINT, FcmConfig, FcmProvider, send_url
from relay.providers.payloads import FcmPayload
from tests.fakes.fcm import (
    FakeFcm,
    make_service_account,
    new_private_key_pem,
    write_service_account,
)
from tests.support.tls import loopback_tls

ACCOUNT = hashlib.sha1(b"xiaomia1@jabber.de\x0092afd7a91cdba9a0").hexdigest()
ROOM = hashlib.sha1(b"room@conference.example\x0092afd7a91cdba9a0").hexdigest()


def new_token() -> str:
    return "fcm-" + secrets.token_urlsafe(40)


def wakeup(token: str | None = None, **kwargs) -> Wakeup:
    return Wakeup(
        push_id=secrets.token_hex(8),
        token=token or new_token(),
        account=kwargs.pop("account", ACCOUNT),
        **kwargs,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def fake():
    with FakeFcm() as server:
        yield server


@pytest.fixture
def make_provider():
    made: list[FcmProvider] = []

    def build(service_account: dict, endpoint: str, timeout: float = 5.0) -> FcmProvider:
        provider = FcmProvider(FcmConfig(service_account, endpoint), timeout=timeout)
        made.append(provider)
        return provider

    yield build
    for provider in made:
        provider.close()


@pytest.fixture
def provider(fake, make_provider):
    return make_provider(fake.service_account(), fake.url)


# --- payload


def test_room_wakeup_payload_is_exactly_the_hashes_and_high_priority(fake, provider):
    token = new_token()
    result = provider.send(wakeup(token, channel=ROOM, important=True, message_count=3))

    assert result == SendResult.delivered()
    (sent,) = fake.wait_for_requests(1)
    assert sent.project == "test-project"
    assert sent.body == {
        "message": {
            "token": token,
            "data": {"account": ACCOUNT, "channel": ROOM},
            "android": {"collapse_key": ROOM[:6], "priority": "high"},
        }
    }


def test_account_wakeup_payload_is_normal_priority_collapsed_on_the_account(fake, provider):
    token = new_token()
    assert provider.send(wakeup(token)).outcome == Outcome.DELIVERED

    (sent,) = fake.wait_for_requests(1)
    assert sent.message == {
        "token": token,
        "data": {"account": ACCOUNT},
        "android": {"collapse_key": ACCOUNT[:6], "priority": "normal"},
    }


def test_important_pushes_carry_the_apps_notification_block_and_silent_ones_none(fake):
    provider = FcmProvider(
        FcmConfig(fake.service_account(), fake.url),
        payload=FcmPayload(push_id_key="push_id", notification_title="New message"),
    )
    try:
        loud, silent = wakeup(important=True), wakeup()
        assert provider.send(loud) == provider.send(silent) == SendResult.delivered()
    finally:
        provider.close()

    [sent_loud], [sent_silent] = fake.requests_for(loud.token), fake.requests_for(silent.token)
    assert sent_loud.message["notification"] == {"title": "New message"}
    assert sent_loud.message["data"] == {"account": ACCOUNT, "push_id": loud.push_id}
    assert "notification" not in sent_silent.message


def test_provider_satisfies_the_interface(provider):
    assert provider.service == "fcm"
    assert isinstance(provider, FcmProvider)
    checked: PushProvider = provider  # a type check, and a runtime smoke of the attributes
    assert callable(checked.send) and callable(checked.close)


# --- OAuth


def test_access_token_comes_from_the_token_uri_and_is_reused(fake, make_provider):
    account = fake.service_account()
    provider = make_provider(account, fake.url)
    for _ in range(3):
        assert provider.send(wakeup()).outcome == Outcome.DELIVERED

    sends = fake.wait_for_requests(3)
    (grant,) = fake.token_grants
    assert grant.client_email == account["client_email"]
    assert "https://www.googleapis.com/auth/cloud-platform" in grant.scope.split()
    bearers = {s.headers["authorization"] for s in sends}
    assert len(bearers) == 1 and bearers.pop().startswith("Bearer ya29.fake-")
    # What firebase-admin's clients send to get FCM's detailed errors.
    assert {s.headers["x-goog-api-format-version"] for s in sends} == {"2"}


def test_many_threads_share_one_token_and_all_deliver(fake, provider):
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(provider.send, [wakeup() for _ in range(80)]))

    assert {r.outcome for r in results} == {Outcome.DELIVERED}
    assert len(fake.wait_for_requests(80)) == 80
    assert len(fake.token_grants) == 1


def test_a_revoked_token_is_refreshed_and_the_send_repeated(fake, provider):
    assert provider.send(wakeup()).outcome == Outcome.DELIVERED
    fake.revoke_access_tokens()

    assert provider.send(wakeup()).outcome == Outcome.DELIVERED
    assert [s.status for s in fake.requests] == [200, 401, 200]
    assert len(fake.token_grants) == 2


def test_token_endpoint_refusing_the_key_is_failed(fake, make_provider):
    stranger = make_service_account(fake.token_uri)  # never registered with the fake
    provider = make_provider(stranger, fake.url)

    assert provider.send(wakeup()) == SendResult(Outcome.FAILED, "OAUTH_REFUSED")
    assert fake.send_count == 0


def test_token_endpoint_checks_the_jwt_signature(fake, make_provider):
    account = fake.service_account()
    forged = dict(account, private_key=new_private_key_pem())  # same account, another key
    provider = make_provider(forged, fake.url)

    assert provider.send(wakeup()) == SendResult(Outcome.FAILED, "OAUTH_REFUSED")
    assert fake.token_grants == [] and fake.send_count == 0


def test_token_endpoint_down_is_retry_later(fake, make_provider):
    account = make_service_account(f"http://127.0.0.1:{free_port()}/token")
    provider = make_provider(account, fake.url)

    assert provider.send(wakeup()) == SendResult(Outcome.RETRY_LATER, "OAUTH_NETWORK")


def test_a_token_endpoint_that_never_answers_is_retry_later_within_the_timeout(make_provider):
    """The token request is held to the provider's timeout (google-auth's own default, which
    `Certificate.get_access_token()` uses, is 120 s: every send waits for the lock meanwhile)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        account = make_service_account(f"http://127.0.0.1:{silent.getsockname()[1]}/token")
        provider = make_provider(account, "http://127.0.0.1:9", timeout=0.3)

        started = time.monotonic()
        assert provider.send(wakeup()) == SendResult(Outcome.RETRY_LATER, "OAUTH_NETWORK")
        assert time.monotonic() - started < 10  # 0.3 s, with room for a loaded machine


# --- outcomes


def test_unregistered_is_a_dead_token(fake, provider):
    token = new_token()
    fake.respond(token, status=404, error_code="UNREGISTERED")

    assert provider.send(wakeup(token)) == SendResult(Outcome.DEAD_TOKEN, "UNREGISTERED")
    assert provider.send(wakeup()).outcome == Outcome.DELIVERED  # other tokens unaffected


def test_sender_id_mismatch_is_a_dead_token(fake, provider):
    token = new_token()
    fake.respond(token, status=403, error_code="SENDER_ID_MISMATCH")

    assert provider.send(wakeup(token)) == SendResult(Outcome.DEAD_TOKEN, "SENDER_ID_MISMATCH")


def test_quota_exceeded_is_retry_later_with_retry_after(fake, provider):
    token = new_token()
    fake.respond(token, status=429, error_code="QUOTA_EXCEEDED", retry_after=30)

    result = provider.send(wakeup(token))

    assert result == SendResult(Outcome.RETRY_LATER, "QUOTA_EXCEEDED", 30.0)
    assert len(fake.requests) == 1


def test_retry_after_as_an_http_date(fake, provider):
    token = new_token()
    when = email.utils.formatdate(time.time() + 120, usegmt=True)
    fake.respond(token, status=429, retry_after=when)

    result = provider.send(wakeup(token))

    assert result.outcome == Outcome.RETRY_LATER
    assert result.retry_after is not None and 100 < result.retry_after <= 121


@pytest.mark.parametrize(
    ("status", "error_code", "expected_code"),
    [
        (503, "UNAVAILABLE", "UNAVAILABLE"),
        (500, "INTERNAL", "INTERNAL"),
        (503, "", "HTTP_503"),
        (502, "", "HTTP_502"),
    ],
)
def test_server_errors_are_retry_later_without_library_backoff(
    fake, provider, status, error_code, expected_code
):
    token = new_token()
    fake.respond(token, status=status, error_code=error_code)

    started = time.monotonic()
    result = provider.send(wakeup(token))
    elapsed = time.monotonic() - started

    assert result == SendResult(Outcome.RETRY_LATER, expected_code)
    assert len(fake.requests_for(token)) == 1  # firebase-admin would have tried 5 times
    assert elapsed < 2.0


def test_503_retry_after_is_passed_on(fake, provider):
    token = new_token()
    fake.respond(token, status=503, retry_after=7)

    assert provider.send(wakeup(token)) == SendResult(Outcome.RETRY_LATER, "UNAVAILABLE", 7.0)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ("The registration token is not a valid FCM registration token", ""),
        ("Request contains an invalid argument.", "message.token"),
    ],
)
def test_invalid_argument_about_the_token_is_a_dead_token(fake, provider, message, field):
    token = new_token()
    fake.respond(token, status=400, error_code="INVALID_ARGUMENT", message=message, field=field)

    assert provider.send(wakeup(token)) == SendResult(Outcome.DEAD_TOKEN, "INVALID_ARGUMENT")


@pytest.mark.parametrize(
    ("error_code", "message", "field", "expected_code"),
    [
        (
            "",
            "Invalid value at 'message.android.priority'",
            "message.android.priority",
            "HTTP_400",
        ),
        ("INVALID_ARGUMENT", "Request contains an invalid argument.", "", "INVALID_ARGUMENT"),
        ("INVALID_ARGUMENT", "Message is too big", "message.data", "INVALID_ARGUMENT"),
    ],
)
def test_invalid_argument_about_our_message_is_failed_not_dead(
    fake, provider, error_code, message, field, expected_code
):
    token = new_token()
    fake.respond(token, status=400, error_code=error_code, message=message, field=field)

    assert provider.send(wakeup(token)) == SendResult(Outcome.FAILED, expected_code)


def test_third_party_auth_error_is_failed(fake, provider):
    token = new_token()
    fake.respond(token, status=401, error_code="THIRD_PARTY_AUTH_ERROR")

    assert provider.send(wakeup(token)) == SendResult(Outcome.FAILED, "THIRD_PARTY_AUTH_ERROR")
    # google-auth refreshes its token and repeats a 401 twice before giving up.
    assert len(fake.requests_for(token)) == 3


def test_permission_denied_is_failed(fake, provider):
    token = new_token()
    fake.respond(token, status=403, error_code="")

    assert provider.send(wakeup(token)) == SendResult(Outcome.FAILED, "HTTP_403")


def test_refused_connection_is_retry_later(fake, make_provider):
    provider = make_provider(fake.service_account(), f"http://127.0.0.1:{free_port()}")

    started = time.monotonic()
    assert provider.send(wakeup()) == SendResult(Outcome.RETRY_LATER, "NETWORK")
    assert time.monotonic() - started < 2.0


def test_fcm_going_away_mid_run_is_retry_later(provider, fake):
    assert provider.send(wakeup()).outcome == Outcome.DELIVERED
    fake.stop()  # also cuts the pooled keep-alive connection

    assert provider.send(wakeup()) == SendResult(Outcome.RETRY_LATER, "NETWORK")


def test_slow_fcm_is_retry_later_after_the_timeout(fake, make_provider):
    provider = make_provider(fake.service_account(), fake.url, timeout=0.3)
    provider.send(wakeup())  # fetch the access token first
    token = new_token()
    fake.respond(token, delay=30.0)  # far past the bound below: room for a loaded machine

    started = time.monotonic()
    assert provider.send(wakeup(token)) == SendResult(Outcome.RETRY_LATER, "TIMEOUT")
    assert time.monotonic() - started < 10


def test_nothing_secret_reaches_the_logs(fake, provider, caplog):
    token = new_token()
    fake.respond(
        token,
        status=400,
        error_code="INVALID_ARGUMENT",
        message=f'Invalid registration token value: "{token}"',
    )
    caplog.set_level(logging.DEBUG)

    assert provider.send(wakeup(token)).outcome == Outcome.DEAD_TOKEN
    logged = " ".join(f"{r.getMessage()} {vars(r)}" for r in caplog.records)
    assert "fcm send not delivered" in logged
    assert token not in logged
    assert "PRIVATE KEY" not in logged
    assert "ya29." not in logged


# --- configuration


def test_parse_accepts_a_service_account_file(fake, tmp_path):
    path = write_service_account(fake.service_account("proj-1"), tmp_path / "sa.json")

    config = FcmConfig.parse(path.read_text(), endpoint=fake.url + "/")

    assert config.project_id == "proj-1"
    assert config.endpoint == fake.url
    assert "PRIVATE KEY" not in repr(config)
    assert FcmConfig.parse(path.read_text()).endpoint == GOOGLE_FCM_ENDPOINT


def _broken(change: dict) -> str:
    account = make_service_account("http://127.0.0.1:1/token")
    account.update(change)
    return json.dumps({k: v for k, v in account.items() if v is not None})


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be an object"),
        (_broken({"type": "authorized_user"}), '"type": "service_account"'),
        (_broken({"project_id": None}), "lacks project_id"),
        (_broken({"client_email": "", "token_uri": None}), "lacks client_email, token_uri"),
        (_broken({"private_key": None}), "lacks private_key"),
        (_broken({"private_key": "-----BEGIN PRIVATE KEY-----\nAAAA\n"}), "does not load"),
        (_broken({"project_id": 12}), "must be text"),
        (_broken({"token_uri": "oauth2.googleapis.com/token"}), "token_uri must be"),
    ],
)
def test_parse_refuses_broken_service_accounts(text, complaint):
    with pytest.raises(ValueError, match=re.escape(complaint)) as info:
        FcmConfig.parse(text)
    assert "AAAA" not in str(info.value)


def test_parse_refuses_a_bad_endpoint():
    text = json.dumps(make_service_account("https://oauth2.googleapis.com/token"))
    with pytest.raises(ValueError, match="endpoint"):
        FcmConfig.parse(text, endpoint="fcm.googleapis.com")


def test_parse_refuses_a_non_rsa_key():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = (
        ec.generate_private_key(ec.SECP256R1())
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    with pytest.raises(ValueError, match="RSA"):
        FcmConfig.parse(_broken({"private_key": pem}))


def test_timeout_defaults_to_the_setting(fake):
    provider = FcmProvider(FcmConfig(fake.service_account(), fake.url))
    try:
        assert provider.timeout == settings.RELAY["PROVIDER_TIMEOUT_SECONDS"]
    finally:
        provider.close()


def test_two_providers_with_different_endpoints_coexist(make_provider):
    with FakeFcm() as first, FakeFcm() as second:
        one = make_provider(first.service_account("project-one"), first.url)
        two = make_provider(second.service_account("project-two"), second.url)
        google = make_provider(make_service_account(first.token_uri), GOOGLE_FCM_ENDPOINT)

        assert one.send(wakeup()).outcome == Outcome.DELIVERED
        assert two.send(wakeup()).outcome == Outcome.DELIVERED
        assert two.send(wakeup()).outcome == Outcome.DELIVERED

        assert [r.project for r in first.requests] == ["project-one"]
        assert [r.project for r in second.requests] == ["project-two"] * 2
        assert one.send_url == f"{first.url}/v1/projects/project-one/messages:send"
        assert google.send_url == (
            "https://fcm.googleapis.com/v1/projects/test-project/messages:send"
        )
        assert messaging._MessagingService.FCM_URL.startswith("https://fcm.googleapis.com/")


# --- lifecycle


def test_close_deletes_the_app_and_is_idempotent(fake, provider):
    name = provider._app.name
    assert firebase_admin.get_app(name) is provider._app

    provider.close()
    provider.close()

    with pytest.raises(ValueError):
        firebase_admin.get_app(name)
    assert provider.send(wakeup()) == SendResult(Outcome.RETRY_LATER, "CLOSED")
    assert fake.send_count == 0


def test_close_works_inside_a_running_event_loop(fake):
    provider = FcmProvider(FcmConfig(fake.service_account(), fake.url), timeout=5)

    async def close_it() -> None:
        provider.close()

    asyncio.run(close_it())
    with pytest.raises(ValueError):
        firebase_admin.get_app(provider._app.name)


# --- the fake itself


def test_fake_refuses_sends_without_a_valid_bearer(fake):
    import requests

    answer = requests.post(
        f"{fake.url}/v1/projects/test-project/messages:send",
        json={"message": {"token": "x"}},
        headers={"Authorization": "Bearer nope"},
        timeout=5,
    )
    assert answer.status_code == 401
    assert answer.json()["error"]["status"] == "UNAUTHENTICATED"


def test_fake_wait_for_requests_times_out(fake):
    with pytest.raises(TimeoutError):
        fake.wait_for_requests(1, timeout=0.1)


def test_fake_keeps_up_with_a_threaded_sender(fake, provider):
    count = 400
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(provider.send, [wakeup() for _ in range(count)]))
    elapsed = time.monotonic() - started

    assert all(r.outcome == Outcome.DELIVERED for r in results)
    assert fake.send_count == count
    assert elapsed < 60, f"{count} sends took {elapsed:.1f}s"


def test_fake_runs_as_a_process(tmp_path):
    import subprocess
    import sys

    import requests

    sa_path = tmp_path / "sa.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.fcm", "--write-service-account", str(sa_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=settings.BASE_DIR,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        provider = FcmProvider(FcmConfig.parse(sa_path.read_text(), info["url"]), timeout=5)
        try:
            assert provider.send(wakeup()).outcome == Outcome.DELIVERED
        finally:
            provider.close()
        stats = requests.get(info["url"] + "/_fake/stats", timeout=5).json()
        assert stats["sends"] == 1 and stats["token_grants"] == 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == 0


def test_no_background_threads_or_requests_to_google(fake):
    """google-auth's regional-access-boundary lookup (a thread that calls
    iamcredentials.googleapis.com) is off for a non-Google endpoint; close leaks nothing."""
    before = {t.ident for t in threading.enumerate()}
    for _ in range(3):
        provider = FcmProvider(FcmConfig(fake.service_account(), fake.url), timeout=5)
        assert provider.send(wakeup()).outcome == Outcome.DELIVERED
        provider.close()
    assert [t.name for t in threading.enumerate() if t.ident not in before] == []


# --- google-auth's regional access boundary lookup, and proxies


class SilentProxy:
    """An HTTP proxy that takes requests (CONNECT or absolute-form) and holds them unanswered
    until `close()`: a lookup started through it stays in flight, so its thread can be seen."""

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
    """The proxy for every scheme, except for 127.0.0.1 (the fake FCM and its token_uri)."""
    proxy = SilentProxy()
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("https_proxy", proxy.url)
    monkeypatch.setenv("http_proxy", proxy.url)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    yield proxy
    proxy.close()


def new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before]


GOOGLE_SEND_URL = send_url(GOOGLE_FCM_ENDPOINT, "test-project")


def test_google_auth_looks_the_boundary_up_in_before_request(fake, proxy):
    """Why the provider never calls `Credentials.before_request`: google-auth then asks
    iamcredentials.googleapis.com for a "regional access boundary", with the access token, in
    a thread, which an FCM send does not need."""
    credential = credentials.Certificate(fake.service_account()).get_credential()

    credential.before_request(GoogleAuthRequest(), "POST", GOOGLE_SEND_URL, {})

    assert proxy.wait_for_request().startswith("CONNECT iamcredentials.googleapis.com:443 ")


def test_google_auth_refresh_alone_looks_nothing_up(fake, proxy):
    """The provider's token path: `refresh` fetches the token and starts no lookup. Fails when
    google-auth moves the lookup there (then the provider needs a look before the upgrade)."""
    credential = credentials.Certificate(fake.service_account()).get_credential()
    before = set(threading.enumerate())

    credential.refresh(GoogleAuthRequest())

    # A lookup would be a thread held at the proxy now.
    assert credential.valid and new_threads(before) == [] and proxy.requests == []
    assert [g.client_email for g in fake.token_grants] == [credential.service_account_email]


def test_a_provider_for_google_sends_through_the_proxy_and_nothing_else(fake, proxy):
    """Google's endpoint, through the environment's proxy: the send is the only request that
    leaves (no boundary lookup), and a proxy that never answers is RETRY_LATER in time."""
    provider = FcmProvider(FcmConfig(fake.service_account(), GOOGLE_FCM_ENDPOINT), timeout=0.3)
    before = set(threading.enumerate())
    try:
        started = time.monotonic()
        assert provider.send(wakeup()).outcome == Outcome.RETRY_LATER
        assert time.monotonic() - started < 10  # 0.3 s, with room for a loaded machine
        assert [r.rsplit(" ", 1)[0] for r in proxy.requests] == ["CONNECT fcm.googleapis.com:443"]
        # The provider loop's own threads (the loop, its token fetches and name lookups) are
        # all that started: a boundary lookup would be one more.
        assert [name for name in new_threads(before) if not name.startswith("provider-loop")] == []
        assert len(fake.token_grants) == 1
    finally:
        provider.close()


def test_no_proxy_is_honoured_and_a_plain_http_endpoint_is_proxied_too(fake, proxy, monkeypatch):
    """The environment's proxy settings as requests reads them, once per provider."""
    direct = FcmProvider(FcmConfig(fake.service_account(), fake.url), timeout=0.3)
    try:
        assert direct.send(wakeup()) == SendResult.delivered()
    finally:
        direct.close()
    assert proxy.requests == []

    monkeypatch.setenv("no_proxy", "localhost")  # the token_uri below, not the endpoint
    account = fake.service_account()
    account["token_uri"] = account["token_uri"].replace("127.0.0.1", "localhost")
    proxied = FcmProvider(FcmConfig(account, fake.url), timeout=0.3)
    try:
        assert proxied.send(wakeup()) == SendResult(Outcome.RETRY_LATER, "TIMEOUT")
        assert (
            proxied.send_many([wakeup(), wakeup()])
            == [SendResult(Outcome.RETRY_LATER, "TIMEOUT")] * 2
        )
    finally:
        proxied.close()
    assert proxy.requests == [f"POST {proxied.send_url} HTTP/1.1"] * 3
    assert fake.send_count == 1 and len(fake.token_grants) == 2


# --- TLS


def test_an_https_endpoint_is_trusted_through_the_configured_ca_bundle_only(tmp_path):
    """FCM over TLS, verified against the provider's CA bundle: a fake FCM whose certificate
    a throw-away CA signed is delivered to with that CA's bundle, and refused (NETWORK,
    nothing sent) with certifi's."""
    server, bundle = loopback_tls(tmp_path, "fake FCM CA")
    with FakeFcm(tls=server) as fake_tls, FakeFcm() as plain:
        trusted = FcmProvider(
            FcmConfig(fake_tls.service_account(), fake_tls.url), timeout=5, ca_bundle=str(bundle)
        )
        # Its token from a plain fake: the refusal below is the send's, not the token's.
        untrusted = FcmProvider(FcmConfig(plain.service_account(), fake_tls.url), timeout=5)
        try:
            assert fake_tls.url.startswith("https://")
            # A lone send (the caller's thread, urllib3) and a batch (the provider loop, aiohttp).
            assert trusted.send(wakeup()) == SendResult.delivered()
            assert trusted.send_many([wakeup(), wakeup()]) == [SendResult.delivered()] * 2
            assert untrusted.send(wakeup()) == SendResult(Outcome.RETRY_LATER, "NETWORK")
            assert (
                untrusted.send_many([wakeup(), wakeup()])
                == [SendResult(Outcome.RETRY_LATER, "NETWORK")] * 2
            )
            assert fake_tls.send_count == 3 and len(plain.token_grants) == 1
        finally:
            trusted.close()
            untrusted.close()
