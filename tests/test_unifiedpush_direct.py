"""The direct path (relay/services/unifiedpush/channel.py): a POST for an online phone is
handed from the web process to the gateway, sent at once and answered when the phone did;
a phone that does not take it within the window gets it stored, and nothing overtakes what
is stored. Real Prosody, gateway and gunicorn, as in test_unifiedpush_e2e."""

from __future__ import annotations

import threading
import time

import pytest

from relay.models import UnifiedPushDelivery, UnifiedPushMessage
from relay.services.unifiedpush import messages
from tests.support.processes import wait_until
from tests.test_unifiedpush_e2e import COMPONENT, lab  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.django_db(transaction=True)]

DIRECT_IDS = 1 << 62


def message_id(headers: dict) -> int:
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
    time.sleep(0.5)
    assert len(phone.pushes_now()) == 3


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
    time.sleep(2)
    assert len(phone.pushes_now()) == 1
    assert UnifiedPushMessage.objects.count() == 1


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
    pushes = phone.wait_for_pushes(3, timeout=10)
    assert [p.body for p in pushes] == [b"stored 0", b"stored 1", b"new"]
    wait_until(lambda: lab.delivered() == 3)
    assert not UnifiedPushMessage.objects.exists()


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
    post.join(timeout=15)
    [(status, headers)] = answers
    assert status == 201
    stored = UnifiedPushMessage.objects.get()
    assert message_id(headers) == stored.pk
    # Back, the phone gets it again (at least once: its first answer never came).
    phone.answer_with = "result"
    lab.start_gateway()
    phone.announce(COMPONENT[0])
    wait_until(lambda: lab.delivered() == 1, timeout=20)
    assert not UnifiedPushMessage.objects.exists()
