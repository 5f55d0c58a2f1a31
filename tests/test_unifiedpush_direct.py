"""The direct path (relay/unifiedpush/services/channel.py): a POST for an online phone is
handed from the web process to the gateway, sent at once and answered when the phone did;
a phone that does not take it within the window gets it stored, and nothing overtakes what
is stored. Real Prosody, gateway and web process, as in test_unifiedpush_e2e."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from email.message import Message
from urllib.parse import urlsplit

import pytest

from relay.unifiedpush.models import ComponentSettings, UnifiedPushDelivery, UnifiedPushMessage
from relay.unifiedpush.services import messages
from tests.support.waiting import holds_for, wait_until
from tests.test_unifiedpush_e2e import COMPONENT, lab  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.django_db(transaction=True)]

DIRECT_IDS = 1 << 62


def message_id(headers: Message) -> int:
    reference = headers["Location"].rsplit("/", 1)[1]
    value = messages.message_id_of(reference)
    assert value is not None, "the Location must name a message resource of ours"
    return value


@pytest.mark.defaults
def test_an_online_phone_has_its_push_before_the_201_and_nothing_is_stored(lab):  # noqa: F811
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    for n in range(3):
        status, headers = lab.post(endpoint.url, f"live {n}".encode(), TTL="60")
        assert status == 201
        assert message_id(headers) >= DIRECT_IDS  # never stored: delivered on the way
        assert headers["TTL"] == "60"
        assert lab.delete(headers["Location"]) == 404  # delivered, nothing to withdraw
    assert [p.body for p in phone.wait_for_pushes(3)] == [b"live 0", b"live 1", b"live 2"]
    wait_until(lambda: lab.delivered() == 3)
    assert not UnifiedPushMessage.objects.exists()
    assert set(UnifiedPushDelivery.objects.values_list("attempts", "size")) == {(1, 6)}
    holds_for(lambda: len(phone.pushes_now()) == 3, 0.5, "each push arrives once")


def test_a_silent_phone_holds_the_post_for_the_window_then_the_message_is_stored(lab):  # noqa: F811
    lab.gateway.stop()
    lab.start_gateway(RELAY_UNIFIEDPUSH_DIRECT_SECONDS="0.6")
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    phone.answer_with = None  # receives, never answers
    started = time.monotonic()
    status, headers = lab.post(endpoint.url, b"are you there")
    waited = time.monotonic() - started
    assert status == 201
    assert waited >= 0.6
    stored = UnifiedPushMessage.objects.get()
    assert message_id(headers) == stored.pk
    assert len(phone.pushes_now()) == 1
    # In flight until its answer timeout (10 s here): not sent again meanwhile.
    holds_for(
        lambda: len(phone.pushes_now()) == 1 and UnifiedPushMessage.objects.count() == 1,
        2,
        "in flight, not sent again",
    )


def test_ttl_0_to_a_silent_phone_is_tried_once_and_never_kept(lab):  # noqa: F811
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    phone.answer_with = None
    status, headers = lab.post(endpoint.url, b"now or never", TTL="0")
    assert status == 201 and headers["TTL"] == "0"
    assert message_id(headers) >= DIRECT_IDS
    assert not UnifiedPushMessage.objects.exists()
    wait_until(lambda: UnifiedPushDelivery.objects.filter(outcome="expired").exists())
    assert len(phone.pushes_now()) == 1


def test_a_restarted_gateway_does_not_let_a_new_message_overtake_stored_ones(lab):  # noqa: F811
    lab.gateway.stop()
    slow_retries = {
        "RELAY_UNIFIEDPUSH_RETRY_BASE_SECONDS": "30",
        "RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS": "60",
    }
    lab.start_gateway(**slow_retries)
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    phone.disconnect()  # offline: Prosody answers service-unavailable
    for n in range(2):
        assert lab.post(endpoint.url, f"stored {n}".encode())[0] == 201
    # The first was refused and waits its backoff (15 s or more); the second waits behind it.
    wait_until(lambda: UnifiedPushMessage.objects.filter(attempts=1).count() == 1)
    assert UnifiedPushMessage.objects.count() == 2
    lab.gateway.stop()  # forgets the phone's backoff
    phone.connect()  # back, without the directed presence that would flush them
    lab.start_gateway(**slow_retries)
    status, _ = lab.post(endpoint.url, b"new")
    assert status == 201
    pushes = phone.wait_for_pushes(3)
    assert [p.body for p in pushes] == [b"stored 0", b"stored 1", b"new"]
    wait_until(lambda: lab.delivered() == 3)
    assert not UnifiedPushMessage.objects.exists()


def offline_phone(lab):  # noqa: F811
    """A phone gone offline (Prosody answers service-unavailable), held back ten minutes once
    a push to it failed; and its endpoint."""
    lab.gateway.stop()
    lab.start_gateway(
        RELAY_UNIFIEDPUSH_RETRY_BASE_SECONDS="600", RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS="600"
    )
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    phone.disconnect()
    return phone, endpoint


def test_a_phone_back_from_away_is_on_the_direct_path_once_its_stored_messages_are_out(lab):  # noqa: F811
    phone, endpoint = offline_phone(lab)
    for n in range(3):
        status, headers = lab.post(endpoint.url, f"stored {n}".encode())
        assert status == 201 and message_id(headers) < DIRECT_IDS
    assert UnifiedPushMessage.objects.count() == 3
    phone.connect()
    phone.announce(COMPONENT[0])  # back: everything stored comes out
    assert [p.body for p in phone.wait_for_pushes(3)] == [b"stored 0", b"stored 1", b"stored 2"]
    wait_until(lambda: lab.delivered() == 3)
    # Nothing is stored any more: POSTs go straight to the phone again as soon as the gateway
    # has taken in the answers (not when it next reads its index, up to 30 s later).
    # 10 s: a loaded machine's room, a third of the index's period.
    sent: list[bytes] = []

    def went_direct() -> bool:
        sent.append(f"after {len(sent)}".encode())
        status, headers = lab.post(endpoint.url, sent[-1])
        assert status == 201, status
        return message_id(headers) >= DIRECT_IDS

    wait_until(
        went_direct, 10, lambda: f"{len(sent)} POSTs still went through the store", interval=0.2
    )
    pushes = phone.wait_for_pushes(3 + len(sent))
    assert [p.body for p in pushes][3:] == sent


def test_ttl_0_for_a_phone_that_is_away_expires_and_never_comes_later(lab):  # noqa: F811
    phone, endpoint = offline_phone(lab)
    assert lab.post(endpoint.url, b"kept")[0] == 201
    wait_until(lambda: UnifiedPushMessage.objects.filter(attempts=1).exists())
    status, headers = lab.post(endpoint.url, b"now or never", TTL="0")
    assert status == 201 and headers["TTL"] == "0"
    phone.connect()
    phone.announce(COMPONENT[0])  # back within a second
    assert lab.post(endpoint.url, b"after")[0] == 201
    wait_until(lambda: any(p.body == b"after" for p in phone.pushes_now()))
    assert [p.body for p in phone.pushes_now()] == [b"kept", b"after"]
    wait_until(lambda: lab.delivered() == 2)
    assert UnifiedPushDelivery.objects.get(ttl=0).outcome == "expired"


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_gateway_gone_during_the_window_loses_nothing(lab, how):  # noqa: F811
    lab.gateway.stop()
    lab.start_gateway(RELAY_UNIFIEDPUSH_DIRECT_SECONDS="5")
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    phone.answer_with = None
    answers: list[tuple[int, dict]] = []
    post = threading.Thread(target=lambda: answers.append(lab.post(endpoint.url, b"in flight")))
    post.start()
    phone.wait_for_pushes(1)
    if how == "stop":
        assert lab.gateway.stop() == 0  # stores what it holds, then answers the POST
    else:
        lab.gateway.kill()  # the web process finds the hop broken and stores it itself
    post.join(timeout=60)
    [(status, headers)] = answers
    assert status == 201
    stored = UnifiedPushMessage.objects.get()
    assert message_id(headers) == stored.pk
    # Back, the phone gets it again (at least once: its first answer never came).
    phone.answer_with = "result"
    lab.start_gateway()
    phone.announce(COMPONENT[0])
    wait_until(lambda: lab.delivered() == 1)
    assert not UnifiedPushMessage.objects.exists()


class KeepAlive:
    """One kept-alive HTTP/1.1 connection, as application servers keep them (the web
    process's event loop serves every request of it)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.path = parts.path
        self.http = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)

    def post(self, body: bytes, **headers: str) -> tuple[int, Message]:
        self.http.request("POST", self.path, body=body, headers=headers)
        response = self.http.getresponse()
        response.read()
        return response.status, response.headers  # looked up by name in any case

    def close(self) -> None:
        self.http.close()


@pytest.mark.defaults
def test_posts_on_a_kept_alive_connection_go_the_direct_path_from_the_event_loop(lab):  # noqa: F811
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    connection = KeepAlive(endpoint.url)
    try:
        for n in range(20):
            status, headers = connection.post(f"kept {n}".encode(), TTL="30")
            assert status == 201 and headers["TTL"] == "30"
            assert message_id(headers) >= DIRECT_IDS
        # The component's state changes (its endpoint URL, which names the Location): once
        # the loop's cached copy is stale, one POST reads it again on the thread pool, and
        # every POST meanwhile and after still goes the direct path.
        settings_row = ComponentSettings.objects.filter(component_id=lab.component.pk)
        cached = settings_row.get().endpoint_url
        moved = cached.rstrip("/") + "/moved"
        settings_row.update(endpoint_url=moved)
        slow = 0

        def answered_with_the_new_state() -> bool:
            nonlocal slow
            status, headers = connection.post(f"slow {slow}".encode())
            slow += 1
            assert status == 201 and message_id(headers) >= DIRECT_IDS
            return headers["Location"].startswith(moved + "/push/message/")

        wait_until(answered_with_the_new_state, 60, "a POST answered from the re-read state")
        status, headers = connection.post(f"slow {slow}".encode())
        slow += 1
        assert status == 201 and headers["Location"].startswith(moved + "/push/message/")
        settings_row.update(endpoint_url=cached)
        other = phone.register_endpoint(COMPONENT[0])
        phone.answer_with = "item-not-found"
        revoked = KeepAlive(other.url)
        assert revoked.post(b"first, the phone refuses it")[0] == 404
        assert revoked.post(b"then the revocation is known")[0] == 404
        revoked.close()
    finally:
        connection.close()
    bodies = [p.body for p in phone.wait_for_pushes(21 + slow)]
    expected = [f"kept {n}".encode() for n in range(20)] + [
        f"slow {n}".encode() for n in range(slow)
    ]
    assert bodies[: 20 + slow] == expected
    wait_until(lambda: lab.delivered() == 20 + slow)
    assert not UnifiedPushMessage.objects.exists()
    holds_for(
        lambda: len(phone.pushes_now()) == 21 + slow,
        0.5,
        "the revoked endpoint's second POST is not sent",
    )


@pytest.mark.parametrize("how", ["stop", "kill", "client hangs up"])
def test_a_post_waiting_in_the_event_loop_is_never_lost(lab, how):  # noqa: F811
    lab.gateway.stop()
    lab.start_gateway(RELAY_UNIFIEDPUSH_DIRECT_SECONDS="3")
    phone = lab.phone()
    endpoint = phone.register_endpoint(COMPONENT[0])
    connection = KeepAlive(endpoint.url)
    assert connection.post(b"first, on a fresh connection")[0] == 201
    phone.answer_with = None
    answers: list[tuple[int, dict]] = []

    def post() -> None:
        with contextlib.suppress(OSError, http.client.HTTPException):
            answers.append(connection.post(b"waiting"))

    waiting = threading.Thread(target=post)
    waiting.start()
    phone.wait_for_pushes(2)
    if how == "stop":
        assert lab.gateway.stop() == 0  # stores what it holds, then answers
    elif how == "kill":
        lab.gateway.kill()  # the web process finds the hop broken and stores it itself
    else:
        connection.http.sock.shutdown(socket.SHUT_RDWR)  # nobody will read the answer
    waiting.join(timeout=60)
    if how != "client hangs up":
        [(status, headers)] = answers
        assert status == 201
        assert message_id(headers) == UnifiedPushMessage.objects.get().pk
    # Stored (by the gateway, or by the web process after the hop broke) in every case.
    wait_until(lambda: UnifiedPushMessage.objects.count() == 1)
    connection.close()
    assert "Traceback" not in lab.web.log_text()
    if how != "client hangs up":
        lab.start_gateway()  # for the fixture's clean stop
