"""The direct path's wire (relay/unifiedpush/services/channel.py), its listener in the
gateway (relay/unifiedpush/gateway/channel.py), its announcement with the leases, and its
start-up check."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.core import checks
from django.test import override_settings

from relay.models import Tenant
from relay.services import link_leases
from relay.unifiedpush.gateway.channel import ChannelServer
from relay.unifiedpush.services import channel
from relay.unifiedpush.services.store import NewMessage
from tests.support.ports import free_port
from tests.support.unifiedpush_components import serving_unifiedpush, set_endpoint_url


def a_message(**changes: object) -> NewMessage:
    now = datetime(2026, 11, 24, 7, 0, tzinfo=UTC)
    fields: dict[str, object] = {
        "tenant_id": 3,
        "component_id": 7,
        "endpoint_key": "e" * 32,
        "recipient_key": "r" * 32,
        "topic_key": "",
        "urgency": 2,
        "received": now,
        "expires": now + timedelta(seconds=60),
        "endpoint_expires": now + timedelta(days=7),
        "size": 5,
        "ttl": 60,
        "sealed": os.urandom(80),
    }
    fields.update(changes)
    return NewMessage(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("topic", ["", "t" * 32])
def test_a_request_reads_back_as_it_was_written(topic):
    message = a_message(topic_key=topic)
    line = channel.encode_request(41, message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert channel.parse_request(line) == (41, message)


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"\n",
        b"1 2 3\n",
        b"x" * 5000 + b"\n",
        channel.encode_request(1, a_message()).replace(b" 60 ", b" sixty ", 1),
        channel.encode_request(1, a_message())[:-5] + b"!!!!\n",  # not base64
        channel.encode_request(1, a_message()).replace(b"1 ", b"\xff ", 1),
        channel.encode_request(1, a_message(received=datetime(9999, 1, 1, tzinfo=UTC))).replace(
            b"253370764800000000", b"9" * 30
        ),
        channel.encode_request(1, a_message()) + b"extra field\n",
    ],
)
def test_a_malformed_request_is_refused(line):
    with pytest.raises(channel.BadRequest):
        channel.parse_request(line)


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:5290", ("::1", 5290)),
        ("off", None),
        ("", None),
    ],
)
def test_the_listen_setting_parses(value, parsed):
    assert channel.parse_bind(value) == parsed


@pytest.mark.parametrize("value", ["5290", "localhost", "host:99999", ":80", "host:port"])
def test_a_wrong_listen_setting_is_refused(value):
    with pytest.raises(ValueError):
        channel.parse_bind(value)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("setting", "value"),
    [("UNIFIEDPUSH_CHANNEL", "localhost"), ("UNIFIEDPUSH_DIRECT_SECONDS", 3600.0)],
)
def test_the_start_up_check_names_a_wrong_setting(settings, setting, value):
    with override_settings(RELAY={**settings.RELAY, setting: value}):
        ids = [message.id for message in checks.run_checks() if message.id == "relay.E012"]
    assert ids == ["relay.E012"]


@pytest.mark.django_db
def test_the_start_up_check_passes_the_defaults():
    assert not [m for m in checks.run_checks() if m.id == "relay.E012"]


def test_an_unreachable_gateway_is_no_verdict_and_the_caller_stores():
    dead = f"127.0.0.1:{free_port()}"
    assert channel.hand_over(dead, a_message(), window=0.5) is None
    channel.forget_connections()


class ListenerLab:
    """A real listener on a loopback port, in its own event loop thread; offers are answered
    from `verdicts` in turn and recorded."""

    def __init__(self, verdicts: list[tuple[str, int | None]]) -> None:
        self.verdicts = verdicts
        self.offered: list[NewMessage] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ChannelServer(("127.0.0.1", 0), self.offer)
        self.address = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(5)

    def offer(self, message: NewMessage) -> asyncio.Future[tuple[str, int | None]]:
        """Every other verdict comes later, from a callback, as the relay's do."""
        self.offered.append(message)
        verdict: asyncio.Future[tuple[str, int | None]] = self.loop.create_future()
        if len(self.offered) % 2:
            verdict.set_result(self.verdicts.pop(0))
        else:
            self.loop.call_later(0.01, verdict.set_result, self.verdicts.pop(0))
        return verdict

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def listener():
    labs: list[ListenerLab] = []

    def make(verdicts: list[tuple[str, int | None]]) -> ListenerLab:
        labs.append(ListenerLab(verdicts))
        return labs[-1]

    yield make
    channel.forget_connections()
    for lab in labs:
        lab.close()


def test_each_verdict_reaches_the_web_process_over_one_kept_connection(listener):
    lab = listener(
        [
            (channel.DELIVERED, None),
            (channel.STORED, 1234),
            (channel.REVOKED, None),
            (channel.NOT_HERE, None),
            (channel.EXPIRED, None),
        ]
    )
    sent = [a_message(size=n) for n in range(5)]
    got = [channel.hand_over(lab.address, message, window=1) for message in sent]
    assert got == [
        channel.Handover(channel.DELIVERED),
        channel.Handover(channel.STORED, 1234),
        channel.Handover(channel.REVOKED),
        channel.Handover(channel.NOT_HERE),
        channel.Handover(channel.EXPIRED),
    ]
    assert lab.offered == sent


def test_the_listener_hangs_up_on_garbage_without_offering_anything(listener):
    lab = listener([])
    host, port = lab.address.rsplit(":", 1)
    for garbage in (b"hello there\n", b"A" * (channel.MAX_LINE + 10), b"1 2\n" * 3):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(garbage)
            assert raw.recv(100) == b""  # closed, no answer
    assert lab.offered == []


@pytest.mark.django_db
def test_the_lease_holder_announces_its_channel_to_the_web_processes():
    tenant = Tenant.objects.create(name="t")
    component = serving_unifiedpush(
        tenant=tenant,
        jid="up.example.org",
        secret="s",
        host="127.0.0.1",
        port=5347,
        endpoint_url="https://push.example.org",
    )
    assert link_leases.channel_of(component.pk) == ""
    link_leases.lease_round(gateway="gw-1", ttl=30, channel="127.0.0.1:5290")
    assert link_leases.channel_of(component.pk) == "127.0.0.1:5290"
    link_leases.leave(gateway="gw-1")
    assert link_leases.channel_of(component.pk) == ""


@pytest.mark.django_db
def test_an_event_loop_reads_a_stale_component_state_once_not_once_per_post():
    from relay.unifiedpush.services import messages

    tenant = Tenant.objects.create(name="t")
    component = serving_unifiedpush(
        tenant=tenant,
        jid="up.example.org",
        secret="s",
        endpoint_url="https://push.example.org",
    )
    cache = messages._PolicyCache()
    with pytest.raises(messages.ColdCache):
        cache.get(component.pk, cached_only=True)  # never read: the caller reads it in a thread
    assert cache.get(component.pk).endpoint_url == "https://push.example.org"
    assert cache.get(component.pk, cached_only=True).endpoint_url == "https://push.example.org"
    set_endpoint_url(component, "https://new.example")
    expires, policy = cache._entries[component.pk]
    cache._entries[component.pk] = (expires - messages.POLICY_SECONDS - 0.1, policy)  # stale
    with pytest.raises(messages.ColdCache):
        cache.get(component.pk, cached_only=True)  # the first one refreshes it
    for _ in range(3):  # the others go on with the stale state meanwhile
        assert cache.get(component.pk, cached_only=True).endpoint_url == "https://push.example.org"
    assert cache.get(component.pk).endpoint_url == "https://new.example"  # the refresh
    assert cache.get(component.pk, cached_only=True).endpoint_url == "https://new.example"
    stale, policy = cache._entries[component.pk]
    cache._entries[component.pk] = (stale - 2 * messages.POLICY_SECONDS - 0.1, policy)
    for _ in range(2):  # too old to serve: every caller reads it
        with pytest.raises(messages.ColdCache):
            cache.get(component.pk, cached_only=True)
