"""The APNs provider through the real aioapns client against an HTTP/2 TLS fake of Apple.

No database: run with `pytest tests/test_apns_provider.py -p no:django`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
import django
from django.apps import apps

if not apps.ready:  # without pytest-django: relay.models holds Outcome; no database is used
    django.setup()

from relay.providers import apns as apns_module
from relay.providers.apns import (
    ApnsConfig,
    ApnsProvider,
    apns_id,
    classify,
)
from relay.providers.base import Outcome, SendResult, Wakeup
from tests.fakes.apns import (
    FakeApns,
    make_client_certificate,
    make_expired_certificate,
    make_p8_key,
)
from tests.support.waiting import wait_until

TOPIC = "org.example.app"
ACCOUNT = "ec164939a8485ee6b7f7871071a11c7bb18aead5"
ROOM = "0123456789abcdef0123456789abcdef01234567"


def token() -> str:
    return secrets.token_hex(32)


def wakeup(device_token: str, *, important: bool = False, channel: str = "", push_id: str = ""):
    return Wakeup(
        push_id=push_id or str(uuid.uuid4()),
        token=device_token,
        account=ACCOUNT,
        channel=channel,
        important=important,
    )


@pytest.fixture(scope="module")
def p8() -> tuple[str, ec.EllipticCurvePublicKey]:
    return make_p8_key()


@pytest.fixture(scope="module")
def fake(p8):
    with FakeApns(topic=TOPIC, public_key=p8[1]) as fake:
        yield fake


@pytest.fixture(autouse=True)
def _fresh_fake(request):
    if "fake" in request.fixturenames:
        request.getfixturevalue("fake").reset()


def token_config(fake: FakeApns, key_pem: str, **overrides) -> ApnsConfig:
    values = {
        "topic": TOPIC,
        "key": key_pem,
        "key_id": fake.key_id,
        "team_id": fake.team_id,
        "endpoint": fake.endpoint,
        "ca_file": fake.ca_file,
    }
    values.update(overrides)
    return ApnsConfig(**values)


@pytest.fixture
def make_provider():
    providers: list[ApnsProvider] = []

    def make(config: ApnsConfig, timeout: float = 3.0) -> ApnsProvider:
        provider = ApnsProvider(config, timeout=timeout)
        providers.append(provider)
        return provider

    yield make
    for provider in providers:
        provider.close()


@pytest.fixture
def provider(fake, p8, make_provider) -> ApnsProvider:
    return make_provider(token_config(fake, p8[0]))


# --- what goes over the wire ---------------------------------------------------------------------


def test_important_push_is_a_generic_alert(provider, fake):
    device = token()
    push = wakeup(device, important=True, channel=ROOM)

    assert provider.send(push).outcome == Outcome.DELIVERED

    (seen,) = fake.requests
    assert seen.token == device
    assert seen.headers["apns-push-type"] == "alert"
    assert seen.headers["apns-priority"] == "10"
    assert seen.headers["apns-topic"] == TOPIC
    assert seen.headers["apns-id"] == push.push_id
    assert seen.headers["apns-collapse-id"] == ROOM[:6]
    assert seen.body == {
        "aps": {"alert": {"title": "New message"}, "sound": "default"},
        "account": ACCOUNT,
        "channel": ROOM,
    }


def test_other_push_is_a_silent_background_wakeup(provider, fake):
    push = wakeup(token())

    assert provider.send(push).outcome == Outcome.DELIVERED

    (seen,) = fake.requests
    assert seen.headers["apns-push-type"] == "background"
    assert seen.headers["apns-priority"] == "5"
    assert seen.headers["apns-id"] == push.push_id
    assert seen.headers["apns-collapse-id"] == ACCOUNT[:6]
    assert seen.body == {"aps": {"content-available": 1}, "account": ACCOUNT}


def test_push_id_that_is_not_a_uuid_becomes_a_stable_one(provider, fake):
    assert provider.send(wakeup(token(), push_id="job-42")).outcome == Outcome.DELIVERED
    assert fake.requests[0].headers["apns-id"] == apns_id("job-42")
    assert apns_id("job-42") == apns_id("job-42")
    upper = str(uuid.uuid4()).upper()
    assert apns_id(upper) == upper.lower()


def test_provider_token_is_a_verified_es256_jwt(provider, fake):
    provider.send(wakeup(token()))

    (seen,) = fake.requests
    assert seen.status == 200
    assert seen.headers["authorization"].startswith("bearer ")
    assert seen.jwt_header is not None and seen.jwt_claims is not None
    assert seen.jwt_header["alg"] == "ES256"
    assert seen.jwt_header["kid"] == fake.key_id
    assert seen.jwt_claims["iss"] == fake.team_id
    assert abs(seen.jwt_claims["iat"] - time.time()) < 60


def test_one_provider_token_serves_new_connections(provider, fake):
    """Apple refuses more than one new token per 20 minutes (TooManyProviderTokenUpdates)."""
    provider.send(wakeup(token()))
    fake.drop_connections()
    _wait_until(lambda: fake.open_connections == 0)
    provider.send(wakeup(token()))

    first, second = fake.requests
    assert first.connection != second.connection
    assert first.headers["authorization"] == second.headers["authorization"]


def test_config_repr_hides_secrets(p8):
    config = _token_auth(p8[0])
    assert "PRIVATE KEY" not in repr(config)
    assert "KEYID12345" in repr(config)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"key": make_p8_key()[0]}, "InvalidProviderToken"),
        ({"key_id": "OTHERKEY00"}, "InvalidProviderToken"),
        ({"team_id": "OTHERTEAM0"}, "InvalidProviderToken"),
    ],
    ids=["other-key", "other-key-id", "other-team"],
)
def test_bad_provider_token_fails(fake, p8, make_provider, overrides, reason):
    provider = make_provider(token_config(fake, p8[0], **overrides))

    result = provider.send(wakeup(token()))

    assert (result.outcome, result.error_code) == (Outcome.FAILED, reason)
    assert fake.requests[0].status == 403


def test_other_topic_is_not_for_this_token(fake, p8, make_provider):
    provider = make_provider(token_config(fake, p8[0], topic="org.example.other"))

    result = provider.send(wakeup(token()))

    assert (result.outcome, result.error_code) == (Outcome.DEAD_TOKEN, "DeviceTokenNotForTopic")


# --- classification ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason", "outcome"),
    [
        (410, "Unregistered", Outcome.DEAD_TOKEN),
        (410, "ExpiredToken", Outcome.DEAD_TOKEN),
        (400, "BadDeviceToken", Outcome.DEAD_TOKEN),
        (400, "DeviceTokenNotForTopic", Outcome.DEAD_TOKEN),
        (429, "TooManyRequests", Outcome.RETRY_LATER),
        (500, "InternalServerError", Outcome.RETRY_LATER),
        (503, "ServiceUnavailable", Outcome.RETRY_LATER),
        (503, "Shutdown", Outcome.RETRY_LATER),
        (403, "InvalidProviderToken", Outcome.FAILED),
        (403, "ExpiredProviderToken", Outcome.FAILED),
        (413, "PayloadTooLarge", Outcome.FAILED),
        (400, "BadTopic", Outcome.FAILED),
        (400, "TopicDisallowed", Outcome.FAILED),
    ],
)
def test_answers_are_classified(provider, fake, status, reason, outcome):
    device = token()
    fake.respond(device, status=status, reason=reason)

    result = provider.send(wakeup(device))

    assert (result.outcome, result.error_code) == (outcome, reason)
    assert fake.requests[0].status == status


def test_classify_without_a_reason_uses_the_status():
    assert classify(200, "") == classify(200, "x")
    assert classify(502, "").outcome == Outcome.RETRY_LATER
    assert classify(502, "").error_code == "502"
    assert classify(405, "MethodNotAllowed").outcome == Outcome.FAILED
    assert classify(400, "").outcome == Outcome.FAILED


def test_scripted_answer_can_be_one_off(provider, fake):
    device = token()
    fake.respond(device, status=503, reason="ServiceUnavailable", times=1)

    assert provider.send(wakeup(device)).outcome == Outcome.RETRY_LATER
    assert provider.send(wakeup(device)).outcome == Outcome.DELIVERED


def test_malformed_token_is_dead_without_asking_apple(provider, fake):
    result = provider.send(wakeup("not/a/token"))

    assert (result.outcome, result.error_code) == (Outcome.DEAD_TOKEN, "BadDeviceToken")
    assert fake.requests == []


# --- a batch: `send_many` -----------------------------------------------------------------------


def test_a_batch_is_classified_as_its_sends_are_one_by_one(provider, fake):
    dead, busy, fine = token(), token(), token()
    fake.respond(dead, status=410, reason="Unregistered")
    fake.respond(busy, status=429, reason="TooManyRequests")
    batch = [wakeup(dead), wakeup("not/a/token"), wakeup(busy), wakeup(fine)]

    one_by_one = [provider.send(w) for w in batch]
    together = provider.send_many([wakeup(w.token) for w in batch])

    assert together == one_by_one
    assert [r.outcome for r in together] == [
        Outcome.DEAD_TOKEN,
        Outcome.DEAD_TOKEN,
        Outcome.RETRY_LATER,
        Outcome.DELIVERED,
    ]
    # The malformed token never reached Apple, either time.
    assert sorted(r.token for r in fake.requests) == sorted([dead, busy, fine] * 2)


def test_a_batch_is_sent_side_by_side(provider, fake):
    devices = [token() for _ in range(8)]
    for device in devices:
        fake.respond(device, delay=1.0)

    results = provider.send_many([wakeup(d) for d in devices])

    assert results == [SendResult.delivered()] * 8
    arrived = [r.received_at for r in fake.requests]
    assert len(arrived) == 8
    assert max(arrived) - min(arrived) < 1.0  # each sent before the first was answered


def test_requests_beyond_the_in_flight_cap_wait_for_a_slot(fake, p8, make_provider, monkeypatch):
    """A provider that stops answering holds at most the cap's requests (what its breaker
    learns from); the next one goes out when one of them ends."""
    monkeypatch.setattr(apns_module, "BATCH_REQUESTS_IN_FLIGHT", 2)
    provider = make_provider(token_config(fake, p8[0]), timeout=10.0)
    slow = [token(), token()]
    for device in slow:
        fake.respond(device, delay=0.5)
    waiting = token()

    results = provider.send_many([wakeup(slow[0]), wakeup(slow[1]), wakeup(waiting)])

    assert results == [SendResult.delivered()] * 3
    first = min(r.received_at for r in fake.requests if r.token in slow)
    (late,) = fake.requests_for(waiting)
    assert late.received_at - first >= 0.45  # after an answer that took 0.5 s


def test_connection_refused_is_retry_later_at_once(p8, make_provider, fake):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    provider = make_provider(token_config(fake, p8[0], endpoint=f"127.0.0.1:{port}"))

    started = time.monotonic()
    result = provider.send(wakeup(token()))

    assert (result.outcome, result.error_code) == (Outcome.RETRY_LATER, "NETWORK")
    assert time.monotonic() - started < 1.0  # no aioapns 1 s sleeps and retries


def test_untrusted_server_certificate_is_retry_later(p8, make_provider, fake):
    config = token_config(fake, p8[0], ca_file="")  # system trust store: the fake is unknown
    result = make_provider(config).send(wakeup(token()))

    assert (result.outcome, result.error_code) == (Outcome.RETRY_LATER, "NETWORK")
    assert fake.requests == []


def test_slow_answer_times_out_and_the_next_send_works(fake, p8, make_provider):
    provider = make_provider(token_config(fake, p8[0]), timeout=0.3)
    slow = token()
    fake.respond(slow, delay=30.0)  # far past the bound below: room for a loaded machine

    started = time.monotonic()
    result = provider.send(wakeup(slow))

    assert (result.outcome, result.error_code) == (Outcome.RETRY_LATER, "TIMEOUT")
    assert time.monotonic() - started < 10
    assert provider.send(wakeup(token())).outcome == Outcome.DELIVERED


def test_dropped_connection_is_retried_once_on_a_new_one(provider, fake):
    device = token()
    fake.respond(device, close_connection=True, times=1)

    assert provider.send(wakeup(device)).outcome == Outcome.DELIVERED

    first, second = fake.wait_for_requests(2)
    assert first.connection != second.connection
    assert first.headers["apns-id"] == second.headers["apns-id"]


def test_connection_dropped_every_time_is_retry_later(provider, fake):
    device = token()
    fake.respond(device, close_connection=True)

    result = provider.send(wakeup(device))

    assert (result.outcome, result.error_code) == (Outcome.RETRY_LATER, "NETWORK")


def test_token_is_never_logged(provider, fake, p8, make_provider, caplog):
    caplog.set_level(logging.DEBUG)
    dead, busy = token(), token()
    fake.respond(dead, status=410, reason="Unregistered")
    fake.respond(busy, status=429, reason="TooManyRequests")
    provider.send(wakeup(dead))
    provider.send(wakeup(busy))
    broken = make_provider(token_config(fake, p8[0], endpoint="127.0.0.1:1"))
    broken.send(wakeup(dead))

    assert "Unregistered" in caplog.text
    assert dead not in caplog.text
    assert busy not in caplog.text


# --- connections, threads and event loops ------------------------------------------------------


def test_many_sends_reuse_one_connection(fake, p8, make_provider):
    before = fake.connection_count
    provider = make_provider(token_config(fake, p8[0]))

    results = [provider.send(wakeup(token())) for _ in range(50)]

    assert {r.outcome for r in results} == {Outcome.DELIVERED}
    assert len(fake.requests) == 50
    assert fake.connection_count - before == 1
    assert len({r.connection for r in fake.requests}) == 1


def test_sends_from_many_threads_at_once(fake, p8, make_provider):
    before = fake.connection_count
    provider = make_provider(token_config(fake, p8[0]))
    devices = [token() for _ in range(80)]
    barrier = threading.Barrier(8)

    def send(device: str):
        if devices.index(device) < 8:
            barrier.wait()
        return provider.send(wakeup(device))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, devices))

    assert {r.outcome for r in results} == {Outcome.DELIVERED}
    assert sorted(r.token for r in fake.requests) == sorted(devices)
    assert fake.connection_count - before <= 2


def test_same_push_id_twice_at_once_does_not_hang(fake, p8, make_provider):
    provider = make_provider(token_config(fake, p8[0]), timeout=2.0)
    slow, other = token(), token()
    fake.respond(slow, delay=0.3)
    push_id = str(uuid.uuid4())

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(provider.send, wakeup(slow, push_id=push_id))
        fake.wait_for_requests(1)
        second = pool.submit(provider.send, wakeup(other, push_id=push_id))
        results = [first.result(), second.result()]

    assert {r.outcome for r in results} == {Outcome.DELIVERED}


def test_sends_from_successive_asyncio_run_calls_and_threads(provider, fake):
    """aioapns used directly breaks here ("Event loop is closed"); our own loop does not."""

    async def from_a_coroutine():
        return provider.send(wakeup(token()))

    async def from_a_worker_thread():
        return await asyncio.to_thread(provider.send, wakeup(token()))

    results = [asyncio.run(from_a_coroutine()), asyncio.run(from_a_worker_thread())]
    thread_results: list = []
    for _ in range(2):
        thread = threading.Thread(
            target=lambda: thread_results.append(asyncio.run(from_a_coroutine()))
        )
        thread.start()
        thread.join(10)

    assert {r.outcome for r in results + thread_results} == {Outcome.DELIVERED}
    assert len(thread_results) == 2


def test_close_releases_the_connection_and_a_later_send_reconnects(provider, fake):
    assert provider.send(wakeup(token())).outcome == Outcome.DELIVERED
    before = fake.connection_count

    provider.close()
    _wait_until(lambda: fake.open_connections == 0)
    assert provider.send(wakeup(token())).outcome == Outcome.DELIVERED

    assert fake.connection_count == before + 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_its_own_loop(provider, fake):
    """Celery prefork: a provider used before the fork must work in the child."""
    assert provider.send(wakeup(token())).outcome == Outcome.DELIVERED

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = 0 if provider.send(wakeup(token())).outcome == Outcome.DELIVERED else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)

    assert os.waitstatus_to_exitcode(status) == 0
    assert provider.send(wakeup(token())).outcome == Outcome.DELIVERED
    assert len(fake.wait_for_requests(3)) == 3


def _wait_until(condition, timeout: float = 30.0) -> None:
    wait_until(condition, timeout, interval=0.01)


# --- certificate auth ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cert_fake():
    with FakeApns(topic=TOPIC, client_certificates=True) as fake:
        yield fake


def test_certificate_auth_delivers(cert_fake, make_provider):
    certificate, key = cert_fake.issue_client_certificate()
    config = ApnsConfig(
        topic=TOPIC,
        certificate=certificate,
        private_key=key,
        endpoint=cert_fake.endpoint,
        ca_file=cert_fake.ca_file,
    )

    assert make_provider(config).send(wakeup(token(), important=True)).outcome == (
        Outcome.DELIVERED
    )

    seen = cert_fake.requests[-1]
    assert f"UID={TOPIC}" in seen.client_subject
    assert "authorization" not in seen.headers


def test_certificate_and_key_in_one_pem(cert_fake, make_provider):
    certificate, key = cert_fake.issue_client_certificate()
    config = ApnsConfig(
        topic=TOPIC,
        certificate=key + certificate,
        endpoint=cert_fake.endpoint,
        ca_file=cert_fake.ca_file,
    )

    assert make_provider(config).send(wakeup(token())).outcome == Outcome.DELIVERED


def test_certificate_apple_does_not_know_is_retry_later(cert_fake, make_provider):
    certificate, key = make_client_certificate(TOPIC)  # self-signed, not from the fake's CA
    config = ApnsConfig(
        topic=TOPIC,
        certificate=certificate,
        private_key=key,
        endpoint=cert_fake.endpoint,
        ca_file=cert_fake.ca_file,
    )

    result = make_provider(config).send(wakeup(token()))

    assert (result.outcome, result.error_code) == (Outcome.RETRY_LATER, "NETWORK")


# --- configuration -------------------------------------------------------------------------------


def _pem(key) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _token_auth(key_pem: str, **overrides) -> ApnsConfig:
    values = {"topic": TOPIC, "key": key_pem, "key_id": "KEYID12345", "team_id": "TEAMID1234"}
    values.update(overrides)
    return ApnsConfig(**values)


def test_valid_token_config(p8):
    config = _token_auth(p8[0])
    config.validate()
    assert config.certificate_not_after is None


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (_pem(ec.generate_private_key(ec.SECP384R1())), "EC P-256.*secp384r1"),
        (_pem(rsa.generate_private_key(public_exponent=65537, key_size=2048)), "EC P-256.*RSA"),
        ("-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n", "not a PEM"),
        ("just some text", "not a PEM"),
        (
            ec.generate_private_key(ec.SECP256R1())
            .private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.BestAvailableEncryption(b"secret"),
            )
            .decode(),
            "encrypted",
        ),
    ],
    ids=["p384", "rsa", "bad-pem", "not-pem", "encrypted"],
)
def test_key_must_be_an_ec_p256_key(key, message):
    with pytest.raises(ValueError, match=message):
        _token_auth(key).validate()


def test_token_auth_needs_key_id_and_team_id(p8):
    with pytest.raises(ValueError, match="key id and the team id"):
        _token_auth(p8[0], key_id="").validate()
    with pytest.raises(ValueError, match="key id and the team id"):
        _token_auth(p8[0], team_id=" ").validate()


def test_exactly_one_auth_kind(p8):
    certificate, key = make_client_certificate(TOPIC)
    with pytest.raises(ValueError, match="exactly one auth kind"):
        ApnsConfig(topic=TOPIC).validate()
    with pytest.raises(ValueError, match="exactly one auth kind"):
        _token_auth(p8[0], certificate=certificate, private_key=key).validate()


def test_topic_is_required(p8):
    with pytest.raises(ValueError, match="topic"):
        _token_auth(p8[0], topic="").validate()


def test_valid_certificate_exposes_its_expiry():
    not_after = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)
    certificate, key = make_client_certificate(TOPIC, not_after=not_after)
    config = ApnsConfig(topic=TOPIC, certificate=certificate, private_key=key)

    config.validate()

    assert config.certificate_not_after == not_after


def test_expired_certificate_is_refused():
    certificate, key = make_expired_certificate(TOPIC)
    config = ApnsConfig(topic=TOPIC, certificate=certificate, private_key=key)

    with pytest.raises(ValueError, match="expired"):
        config.validate()
    assert config.certificate_not_after is not None
    assert config.certificate_not_after < datetime.now(UTC)


def test_certificate_not_yet_valid_is_refused():
    start = datetime.now(UTC) + timedelta(days=1)
    certificate, key = make_client_certificate(
        TOPIC, not_before=start, not_after=start + timedelta(days=1)
    )
    with pytest.raises(ValueError, match="not valid before"):
        ApnsConfig(topic=TOPIC, certificate=certificate, private_key=key).validate()


def test_certificate_problems():
    certificate, _ = make_client_certificate(TOPIC)
    _, other_key = make_client_certificate(TOPIC)
    with pytest.raises(ValueError, match="does not belong"):
        ApnsConfig(topic=TOPIC, certificate=certificate, private_key=other_key).validate()
    with pytest.raises(ValueError, match="needs the certificate's private key"):
        ApnsConfig(topic=TOPIC, certificate=certificate).validate()
    with pytest.raises(ValueError, match="not a PEM certificate"):
        ApnsConfig(topic=TOPIC, certificate="garbage", private_key=other_key).validate()
    broken = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    with pytest.raises(ValueError, match="cannot be parsed"):
        ApnsConfig(topic=TOPIC, certificate=broken, private_key=other_key).validate()


def test_provider_refuses_a_bad_config():
    with pytest.raises(ValueError):
        ApnsProvider(ApnsConfig(topic=TOPIC), timeout=1.0)


@pytest.mark.parametrize(
    ("sandbox", "endpoint", "address"),
    [
        (False, "", ("api.push.apple.com", 443)),
        (True, "", ("api.sandbox.push.apple.com", 443)),
        (False, "127.0.0.1:8443", ("127.0.0.1", 8443)),
        (True, "https://apns.example.net", ("apns.example.net", 443)),
        (False, "https://[::1]:2197/", ("::1", 2197)),
    ],
)
def test_endpoint(p8, sandbox, endpoint, address):
    assert _token_auth(p8[0], sandbox=sandbox, endpoint=endpoint).address == address


@pytest.mark.parametrize(
    "endpoint", ["http://host", "host:notaport", "https://host/3/device", ":443"]
)
def test_bad_endpoint(p8, endpoint):
    with pytest.raises(ValueError, match="endpoint"):
        _token_auth(p8[0], endpoint=endpoint).validate()


def test_missing_ca_file(p8):
    with pytest.raises(ValueError, match="CA file"):
        _token_auth(p8[0], ca_file="/nonexistent/ca.pem").validate()
