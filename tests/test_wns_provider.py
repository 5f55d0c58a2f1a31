"""The WNS client through a real socket against the fake WNS: wire format, tokens, outcomes.

No database: runs with `-p no:django` too, so Django is set up here for `relay.models.Outcome`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import django
import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
django.setup()

from relay.providers.base import (  # noqa: E402
    Outcome,
    SendResult,
    Wakeup,
)
from relay.providers.wns import (  # noqa: E402
    WnsConfig,
    WnsProvider,
    channel_uri_allowed,
    parse_retry_after,
)
from tests.fakes.wns import FakeReply, FakeWns  # noqa: E402

ACCOUNT = "e5397e96c6ff4d629ab9f203eec3ff17c777b2127cf1b41005e54877487ba982"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake() -> Iterator[FakeWns]:
    with FakeWns() as server:
        yield server


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make_provider(fake: FakeWns, clock: Clock) -> Iterator:
    made: list[WnsProvider] = []

    def make(**overrides: object) -> WnsProvider:
        timeout = overrides.pop("timeout", 2.0)
        fields: dict = {
            "package_sid": fake.client_id,
            "secret": fake.client_secret,
            "token_url": fake.token_url,
            "channel_hosts": (fake.host_pattern,),
            **overrides,
        }
        provider = WnsProvider(WnsConfig(**fields), timeout=timeout, clock=clock)
        made.append(provider)
        return provider

    yield make
    for provider in made:
        provider.close()


@pytest.fixture
def provider(make_provider) -> WnsProvider:
    return make_provider()


@pytest.fixture(params=["lone", "batch"])
def send(request):
    """A wake-up sent alone (httpx, in this thread) or as a batch (aiohttp, on the provider
    loop): the same request on the wire, the same classification, the same token handling."""
    if request.param == "lone":
        return lambda provider, w: provider.send(w)
    return lambda provider, w: provider.send_many([w])[0]


def wakeup(fake: FakeWns, channel: str = "c1", **fields: object) -> Wakeup:
    values: dict = {"push_id": "push-1", "token": fake.channel_uri(channel), "account": ACCOUNT}
    values.update(fields)
    return Wakeup(**values)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- Wire format ------------------------------------------------------------------------------


def test_important_wakeup_has_exact_headers_and_body(fake, provider, send):
    result = send(
        provider, wakeup(fake, important=True, message_count=3, pending_subscription_count=1)
    )

    assert result == SendResult(Outcome.DELIVERED)
    [request] = fake.requests
    [token] = fake.issued_tokens
    assert request.path == "/channel/c1?token=c1-opaque"
    assert request.headers["authorization"] == f"Bearer {token}"
    assert request.headers["content-type"] == "application/octet-stream"
    assert request.headers["x-wns-type"] == "wns/raw"
    assert request.headers["x-wns-requestforstatus"] == "true"
    assert request.headers["x-wns-priority"] == "1"
    assert request.headers["x-wns-cache-policy"] == "cache"
    assert request.body == (
        b'{"version":2,"action":"push","account_id":"' + ACCOUNT.encode() + b'",'
        b'"message_count":3,"pending_subscription_count":1}'
    )
    assert fake.token_forms == [
        {
            "grant_type": "client_credentials",
            "client_id": fake.client_id,
            "client_secret": fake.client_secret,
            "scope": "notify.windows.com",
        }
    ]


def test_silent_wakeup_is_low_priority_uncached_with_zero_counts(fake, provider, send):
    assert send(provider, wakeup(fake)).outcome == Outcome.DELIVERED

    [request] = fake.requests
    assert request.headers["x-wns-priority"] == "3"
    assert request.headers["x-wns-cache-policy"] == "no-cache"
    assert request.json() == {
        "version": 2,
        "action": "push",
        "account_id": ACCOUNT,
        "message_count": 0,
        "pending_subscription_count": 0,
    }


def test_redirects_are_not_followed(fake, provider, send):
    fake.queue_replies("c1", FakeReply(302, None, {"Location": fake.channel_uri("elsewhere")}))

    assert send(provider, wakeup(fake)) == SendResult(Outcome.FAILED, "HTTP_302")
    assert len(fake.requests) == 1


# --- Tokens -----------------------------------------------------------------------------------


def test_token_is_fetched_once_and_reused(fake, provider, send):
    for n in range(5):
        assert send(provider, wakeup(fake, f"c{n}")).outcome == Outcome.DELIVERED

    assert fake.token_requests == 1
    assert len({r.headers["authorization"] for r in fake.requests}) == 1


def test_token_is_refreshed_before_it_expires(fake, make_provider, clock, send):
    fake.token_lifetime = 600  # refreshed 60 s early: a tenth of the lifetime
    provider = make_provider()
    send(provider, wakeup(fake))
    clock.now += 539
    send(provider, wakeup(fake))
    assert fake.token_requests == 1

    clock.now += 2
    assert send(provider, wakeup(fake)).outcome == Outcome.DELIVERED
    assert fake.token_requests == 2
    assert [r.status for r in fake.requests] == [200, 200, 200]


def test_rejected_token_is_refreshed_once_and_the_send_retried(fake, provider, send):
    send(provider, wakeup(fake))
    fake.revoke_tokens()

    assert send(provider, wakeup(fake)) == SendResult(Outcome.DELIVERED)
    assert fake.token_requests == 2
    assert [r.status for r in fake.requests] == [200, 401, 200]
    first, second = fake.token_forms
    assert first == second


def test_persistent_401_fails_after_exactly_two_posts(fake, provider, send):
    fake.set_default_reply("c1", FakeReply(401, None))

    assert send(provider, wakeup(fake)) == SendResult(Outcome.FAILED, "HTTP_401")
    assert len(fake.requests) == 2
    assert fake.token_requests == 2
    first, second = (r.headers["authorization"] for r in fake.requests)
    assert first != second


def test_concurrent_sends_share_one_token_fetch(fake, provider):
    fake.token_delay = 0.2  # every thread arrives while the first fetch is still running
    threads = 12
    barrier = threading.Barrier(threads)
    results: list[SendResult] = []

    def send(n: int) -> None:
        barrier.wait()
        results.append(provider.send(wakeup(fake, f"c{n}")))

    workers = [threading.Thread(target=send, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=10)

    assert results == [SendResult(Outcome.DELIVERED)] * threads
    assert fake.token_requests == 1
    assert len({r.headers["authorization"] for r in fake.wait_for_requests(threads)}) == 1


def test_concurrent_401s_share_one_refresh(fake, provider):
    provider.send(wakeup(fake))
    fake.revoke_tokens()
    threads = 8
    barrier = threading.Barrier(threads)
    results: list[SendResult] = []

    def send(n: int) -> None:
        barrier.wait()
        results.append(provider.send(wakeup(fake, f"c{n}")))

    workers = [threading.Thread(target=send, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=10)

    assert results == [SendResult(Outcome.DELIVERED)] * threads
    assert fake.token_requests == 2


# --- Token endpoint failures ------------------------------------------------------------------


def test_wrong_credentials_fail_with_auth_and_send_nothing(fake, make_provider, send):
    provider = make_provider(secret="not-the-secret")

    assert send(provider, wakeup(fake)) == SendResult(Outcome.FAILED, "AUTH")
    assert fake.requests == []


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (503, {"Retry-After": "30"}, SendResult(Outcome.RETRY_LATER, "AUTH_HTTP_503", 30.0)),
        (500, {}, SendResult(Outcome.RETRY_LATER, "AUTH_HTTP_500")),
        (429, {"Retry-After": "5"}, SendResult(Outcome.RETRY_LATER, "AUTH_HTTP_429", 5.0)),
        (401, {}, SendResult(Outcome.FAILED, "AUTH")),
    ],
)
def test_token_endpoint_errors(fake, provider, status, headers, expected, send):
    fake.fail_token_requests(status, {"error": "server_error"}, headers=headers)

    assert send(provider, wakeup(fake)) == expected
    assert fake.requests == []


def test_unusable_token_answer_is_temporary(fake, provider, send):
    fake.fail_token_requests(200, {"token_type": "bearer"})

    assert send(provider, wakeup(fake)) == SendResult(Outcome.RETRY_LATER, "AUTH_BAD_RESPONSE")


def test_unreachable_token_endpoint_is_temporary(fake, make_provider, send):
    provider = make_provider(token_url=f"http://127.0.0.1:{closed_port()}/accesstoken.srf")

    assert send(provider, wakeup(fake)) == SendResult(Outcome.RETRY_LATER, "AUTH_NETWORK")


def test_token_failure_is_held_briefly_instead_of_hammering_the_endpoint(
    fake, provider, clock, send
):
    fake.fail_token_requests(503)

    first = send(provider, wakeup(fake))
    assert send(provider, wakeup(fake)) == first == SendResult(Outcome.RETRY_LATER, "AUTH_HTTP_503")
    assert fake.token_requests == 1

    clock.now += 6
    assert send(provider, wakeup(fake)).outcome == Outcome.DELIVERED
    assert fake.token_requests == 2


# --- Channel answers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (FakeReply(200, "received"), SendResult(Outcome.DELIVERED)),
        (FakeReply(200, None), SendResult(Outcome.DELIVERED)),
        (FakeReply(200, "dropped"), SendResult(Outcome.DELIVERED, "DROPPED")),
        (FakeReply(200, "channelthrottled"), SendResult(Outcome.RETRY_LATER, "THROTTLED")),
        (
            FakeReply(200, None, {"X-WNS-NotificationStatus": "dropped"}),
            SendResult(Outcome.DELIVERED, "DROPPED"),
        ),
        (FakeReply(404, None), SendResult(Outcome.DEAD_TOKEN, "HTTP_404")),
        (FakeReply(410, None), SendResult(Outcome.DEAD_TOKEN, "HTTP_410")),
        (FakeReply(406, None), SendResult(Outcome.RETRY_LATER, "THROTTLED")),
        (
            FakeReply(406, None, {"Retry-After": "30"}),
            SendResult(Outcome.RETRY_LATER, "THROTTLED", 30.0),
        ),
        (
            FakeReply(429, None, {"Retry-After": "120"}),
            SendResult(Outcome.RETRY_LATER, "THROTTLED", 120.0),
        ),
        (FakeReply(500, None), SendResult(Outcome.RETRY_LATER, "HTTP_500")),
        (
            FakeReply(503, None, {"Retry-After": "7"}),
            SendResult(Outcome.RETRY_LATER, "HTTP_503", 7.0),
        ),
        (FakeReply(400, None), SendResult(Outcome.FAILED, "HTTP_400")),
        (FakeReply(403, None), SendResult(Outcome.FAILED, "HTTP_403")),
        (FakeReply(405, None), SendResult(Outcome.FAILED, "HTTP_405")),
        (FakeReply(413, None), SendResult(Outcome.FAILED, "HTTP_413")),
    ],
    ids=lambda value: getattr(value, "status", None) or getattr(value, "error_code", None),
)
def test_channel_answers_are_classified(fake, provider, reply, expected, send):
    fake.queue_replies("c1", reply)

    assert send(provider, wakeup(fake)) == expected
    assert len(fake.requests) == 1  # only a 401 is ever retried inside the provider


def test_a_batch_is_classified_as_its_sends_one_by_one(fake, make_provider):
    provider = make_provider(channel_hosts=(fake.host_pattern, "*.notify.windows.com"))
    elsewhere = wakeup(fake, token="https://evil.example.org/channel/x")
    for channel, reply in [("gone", FakeReply(410, None)), ("busy", FakeReply(429, None))]:
        fake.set_default_reply(channel, reply)
    batch = [wakeup(fake, "gone"), elsewhere, wakeup(fake, "busy"), wakeup(fake, "fine")]

    one_by_one = [provider.send(w) for w in batch]
    together = provider.send_many(batch)

    assert (
        together
        == one_by_one
        == [
            SendResult(Outcome.DEAD_TOKEN, "HTTP_410"),
            SendResult(Outcome.FAILED, "CHANNEL_HOST_NOT_ALLOWED"),
            SendResult(Outcome.RETRY_LATER, "THROTTLED"),
            SendResult(Outcome.DELIVERED),
        ]
    )
    channels = sorted(request.channel_id for request in fake.requests)
    assert channels == ["busy", "busy", "fine", "fine", "gone", "gone"]  # each way once


def test_a_batch_is_sent_side_by_side(fake, make_provider):
    provider = make_provider(timeout=5.0)
    channels = [f"c{n}" for n in range(4)]
    for channel in channels:
        fake.queue_replies(channel, FakeReply(200, "received", delay=1.0))

    results = provider.send_many([wakeup(fake, channel) for channel in channels])

    assert results == [SendResult(Outcome.DELIVERED)] * 4
    arrived = [request.received_at for request in fake.requests]
    assert len(arrived) == 4
    # Recorded as each is answered, 1 s after it arrived: one after the other would be 1 s apart.
    assert max(arrived) - min(arrived) < 1.0


def test_a_batchs_401s_share_one_refresh_and_are_sent_once_more(fake, provider):
    provider.send(wakeup(fake))
    fake.revoke_tokens()

    results = provider.send_many([wakeup(fake, f"c{n}") for n in range(3)])

    assert results == [SendResult(Outcome.DELIVERED)] * 3
    assert fake.token_requests == 2
    assert sorted(r.status for r in fake.requests) == [200] * 4 + [401] * 3


def test_a_batchs_persistent_401s_fail_after_exactly_two_posts_each(fake, provider):
    for channel in ("c1", "c2"):
        fake.set_default_reply(channel, FakeReply(401, None))

    results = provider.send_many([wakeup(fake, "c1"), wakeup(fake, "c2")])

    assert results == [SendResult(Outcome.FAILED, "HTTP_401")] * 2
    assert len(fake.requests) == 4
    assert fake.token_requests == 2


def test_retry_after_as_http_date_is_honoured(fake, provider, send):
    when = datetime.now(UTC) + timedelta(seconds=60)
    fake.queue_replies("c1", FakeReply(429, None, {"Retry-After": format_datetime(when, True)}))

    result = send(provider, wakeup(fake))

    assert (result.outcome, result.error_code) == (Outcome.RETRY_LATER, "THROTTLED")
    assert result.retry_after is not None and 50 < result.retry_after <= 60


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("120", 120.0), (" 1.5 ", 1.5), ("-3", 0.0), ("", None), (None, None), ("soon", None),
     ("nan", None), ("inf", None), ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0)],
)  # fmt: skip
def test_parse_retry_after(header, seconds):
    assert parse_retry_after(header) == seconds


def test_channel_timeout_is_temporary(fake, make_provider, send):
    provider = make_provider(timeout=0.3)
    fake.queue_replies("c1", FakeReply(200, "received", delay=1.0))

    assert send(provider, wakeup(fake)) == SendResult(Outcome.RETRY_LATER, "TIMEOUT")


def test_unreachable_channel_is_temporary(fake, make_provider, send):
    provider = make_provider(channel_hosts=("127.0.0.1:*",))
    gone = wakeup(fake, token=f"http://127.0.0.1:{closed_port()}/channel/c1")

    assert send(provider, gone) == SendResult(Outcome.RETRY_LATER, "NETWORK")


def test_channel_host_not_allowed_sends_nothing(fake, make_provider, send):
    provider = make_provider(channel_hosts=("*.notify.windows.com",))

    assert send(provider, wakeup(fake)) == SendResult(Outcome.FAILED, "CHANNEL_HOST_NOT_ALLOWED")
    assert fake.token_requests == 0
    assert fake.requests == []


def test_send_after_close_is_temporary_not_an_exception(fake, provider, send):
    provider.close()

    assert send(provider, wakeup(fake)) == SendResult(Outcome.RETRY_LATER, "CLOSED")


def test_timeout_defaults_to_the_setting(fake):
    from django.conf import settings

    config = WnsConfig(fake.client_id, fake.client_secret, fake.token_url, (fake.host_pattern,))
    provider = WnsProvider(config)
    try:
        assert provider._client.timeout.read == settings.RELAY["PROVIDER_TIMEOUT_SECONDS"]
    finally:
        provider.close()


# --- Secrets stay out of logs and results -----------------------------------------------------


def test_no_channel_uri_secret_or_token_in_logs_or_results(fake, provider, caplog, send):
    caplog.set_level(logging.DEBUG)
    fake.queue_replies("c1", FakeReply(200), FakeReply(403, None), FakeReply(410, None))
    results = [send(provider, wakeup(fake)) for _ in range(3)]
    fake.revoke_tokens()
    results.append(send(provider, wakeup(fake)))
    wrong = WnsConfig(fake.client_id, "wrong-secret", fake.token_url, (fake.host_pattern,))
    refused = WnsProvider(wrong, timeout=2)
    try:
        results.append(send(refused, wakeup(fake)))
    finally:
        refused.close()

    text = caplog.text + repr(results) + repr(provider._config)
    for secret in [fake.channel_uri("c1"), "c1-opaque", fake.client_secret, "wrong-secret",
                   *fake.issued_tokens]:  # fmt: skip
        assert secret not in text
    assert "push-1" in caplog.text  # the logs do say which push


# --- Configuration ----------------------------------------------------------------------------


def test_the_defaults_are_microsofts_endpoints_and_a_provider_takes_them():
    config = WnsConfig("ms-app://s-1-15-2-1-2-3", "secret")
    assert (config.token_url, config.channel_hosts) == (
        "https://login.live.com/accesstoken.srf",
        ("*.notify.windows.com",),
    )
    provider = WnsProvider(config, timeout=1)  # validates the configuration
    try:
        assert provider.service == "wns"
        assert channel_uri_allowed("https://db5p.notify.windows.com/?token=x", config.channel_hosts)
    finally:
        provider.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"package_sid": ""}, "package SID"),
        ({"package_sid": "s-1-15-2-1"}, "package SID"),
        ({"package_sid": "ms-app://"}, "package SID"),
        ({"package_sid": "ms-app://s-1 "}, "package SID"),
        ({"secret": ""}, "secret is empty"),
        ({"secret": "abc\n"}, "whitespace"),
        ({"token_url": "http://login.live.com/accesstoken.srf"}, "token URL"),
        ({"token_url": "https://user@login.live.com/accesstoken.srf"}, "token URL"),
        ({"token_url": "ftp://login.live.com/"}, "token URL"),
        ({"channel_hosts": "*.notify.windows.com"}, "non-empty list"),
        ({"channel_hosts": ()}, "non-empty list"),
        ({"channel_hosts": ("*",)}, "pattern"),
        ({"channel_hosts": ("*.com",)}, "two labels"),
        ({"channel_hosts": ("bad host",)}, "pattern"),
        ({"channel_hosts": ("127.0.0.1:0",)}, "port"),
        ({"channel_hosts": ("127.0.0.1:https",)}, "port"),
        ({"channel_hosts": ("[::1",)}, "IPv6"),
    ],
)
def test_invalid_config_is_refused_clearly(fields, message):
    values: dict = {"package_sid": "ms-app://s-1-15-2-1-2-3", "secret": "secret", **fields}
    with pytest.raises(ValueError, match=message):
        WnsConfig(**values).validate()
    with pytest.raises(ValueError, match=message):
        WnsProvider(WnsConfig(**values), timeout=1)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_token_url_is_allowed_over_http(make_provider, fake, host, send):
    """Plain http for the token only on loopback (a local fake or proxy): the provider takes
    its token there and delivers."""
    token_url = fake.token_url.replace("127.0.0.1", host)
    assert token_url.startswith(f"http://{host}:")
    provider = make_provider(token_url=token_url)
    assert send(provider, wakeup(fake)).outcome == Outcome.DELIVERED
    assert len(fake.issued_tokens) == 1
    with pytest.raises(ValueError, match="token URL"):
        WnsConfig(fake.client_id, "x", token_url.replace(host, "relay.example")).validate()


def test_config_repr_hides_the_secret():
    assert "hunter2" not in repr(WnsConfig("ms-app://s-1", "hunter2"))


# --- Channel URI allow-list -------------------------------------------------------------------

WNS_HOSTS = ("*.notify.windows.com",)


@pytest.mark.parametrize(
    "uri",
    [
        "https://wns2-by3p.notify.windows.com/w/?token=BQYAAAD%2bq%2f",
        "https://DB5.Notify.Windows.com/?token=x",
        "https://a.b.notify.windows.com:443/w/",
        "https://xn--bcher-kva.notify.windows.com/w/",
    ],
)
def test_real_channel_uris_are_allowed(uri):
    assert channel_uri_allowed(uri, WNS_HOSTS)


@pytest.mark.parametrize(
    "uri",
    [
        "http://wns2-by3p.notify.windows.com/w/?token=x",
        "https://notify.windows.com/w/",
        "https://notify.windows.com.evil.org/w/",
        "https://wns2.notify.windows.com.evil.org/w/",
        "https://evilnotify.windows.com/w/",
        "https://user@wns2.notify.windows.com/w/",
        "https://user:pw@wns2.notify.windows.com/w/",
        "https://wns2.notify.windows.com@evil.org/w/",
        "https://wns2.notify.windows.com:443@evil.org/w/",
        "https://evil.org\\@wns2.notify.windows.com/w/",
        "https://evil.org\\.notify.windows.com/w/",
        "https://evil.org#@wns2.notify.windows.com/w/",
        "https://evil.org?@wns2.notify.windows.com/w/",
        "https://wns2.notify.windows.com/w/#fragment",
        "https://wns2.notify.windows.com:8443/w/",
        "https://wns2.notify.windows.com:99999/w/",
        "https://wns2.notify.windows.com./w/",
        "https://wns2.notify.windows.com%2eevil.org/w/",
        "https://evil.org%2f.notify.windows.com/w/",
        "https://wns_2.notify.windows.com/w/",
        "https://-wns2.notify.windows.com/w/",
        "https://.notify.windows.com/w/",
        "https://a..notify.windows.com/w/",
        "https://bücher.notify.windows.com/w/",
        " https://wns2.notify.windows.com/w/",
        "https://wns2.notify.windows.com/w/\n",
        "https://wns2.notify.win\tdows.com/w/",
        "https://wns2.notify.windows.com/w/ x",
        "https://1.2.3.4/w/",
        "https://[::1]/w/",
        "https://127.0.0.1/w/",
        "https://localhost/w/",
        "wns2.notify.windows.com/w/",
        "//wns2.notify.windows.com/w/",
        "https:///wns2.notify.windows.com/w/",
        "ftp://wns2.notify.windows.com/w/",
        "javascript:alert(1)//.notify.windows.com",
        "",
    ],
)
def test_hostile_channel_uris_are_refused(uri):
    assert not channel_uri_allowed(uri, WNS_HOSTS)


def test_non_string_channel_uri_is_refused():
    assert not channel_uri_allowed(None, WNS_HOSTS)  # type: ignore[arg-type]
    assert not channel_uri_allowed(b"https://wns2.notify.windows.com/", WNS_HOSTS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("hosts", "uri", "allowed"),
    [
        (("127.0.0.1:*",), "http://127.0.0.1:8080/channel/1", True),
        (("127.0.0.1:*",), "https://127.0.0.1:1/channel/1", True),
        (("127.0.0.1:*",), "http://127.0.0.2:8080/channel/1", False),
        (("127.0.0.1:*",), "http://127.1:8080/channel/1", False),
        (("127.0.0.1:*",), "http://2130706433:8080/channel/1", False),
        (("127.0.0.1:*",), "http://localhost:8080/channel/1", False),
        (("127.0.0.1:*",), "http://[::ffff:127.0.0.1]:8080/channel/1", False),
        (("127.0.0.1:*",), "http://u@127.0.0.1:8080/channel/1", False),
        (("127.0.0.1:8443",), "http://127.0.0.1:8443/c", True),
        (("127.0.0.1:8443",), "http://127.0.0.1:8444/c", False),
        (("127.0.0.1:8443",), "http://127.0.0.1/c", False),
        (("localhost",), "http://localhost/c", True),
        (("localhost",), "http://localhost:8080/c", False),
        (("[::1]:*",), "http://[::1]:9/c", True),
        # urllib and httpx read ::ffff:1.2.3.4, aiohttp's yarl ::ffff:102:304: refused, since
        # a batch would connect by yarl's reading and a lone send by httpx's.
        (("[::ffff:1.2.3.4]:*",), "https://[::ffff:1.2.3.4]/c", False),
        (("[::ffff:102:304]:*",), "https://[::ffff:102:304]/c", True),
        (("wns.example.net",), "https://wns.example.net/c", True),
        (("wns.example.net",), "http://wns.example.net/c", False),
        (("wns.example.net",), "https://a.wns.example.net/c", False),
        (("*.notify.windows.com:*",), "https://a.notify.windows.com:8443/c", True),
        (("*", "bad host", "*.com"), "https://evil.org/c", False),
        (("*", "bad host", *WNS_HOSTS), "https://a.notify.windows.com/c", True),
        ((), "https://a.notify.windows.com/c", False),
        ((None, ["x"], *WNS_HOSTS), "https://a.notify.windows.com/c", True),
    ],
)
def test_host_patterns(hosts, uri, allowed):
    assert channel_uri_allowed(uri, hosts) is allowed


def test_fake_channel_uris_pass_the_fakes_pattern(fake):
    assert channel_uri_allowed(fake.channel_uri("x"), (fake.host_pattern,))
    assert not channel_uri_allowed(fake.channel_uri("x"), WNS_HOSTS)
