"""The gateway's UnifiedPush state machine on its own (no network, no database): what it
sends, what answers it accepts, and what it forgets."""

from __future__ import annotations

import asyncio
import base64
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

import pytest

from relay.unifiedpush.gateway.phones import Recipient
from relay.unifiedpush.gateway.relay import UnifiedPushRelay
from relay.unifiedpush.services import UP_NS, messages, tokens
from relay.unifiedpush.services.store import NewMessage, StoredMessage
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.defaults

JID = "juliet@example.com/phone"


class Wire:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_raw(self, data: str | bytes) -> None:
        self.sent.append(data if isinstance(data, bytes) else data.encode())


async def no_database(fn, *args, **kwargs):
    if fn.__name__ == "revoked_keys":
        return set()
    return [] if fn.__name__ in ("due", "for_recipient", "by_ids", "stored_index") else 0


def stored(message_id: int, body: bytes = b"hi", *, ttl: int = 60) -> StoredMessage:
    _, endpoint = tokens.issue(
        jid=JID,
        application=b"a" * 32,
        instance=b"i" * 32,
        component_id=1,
        expires=int(time.time()) + 3600,
    )
    now = datetime.now(UTC)
    return StoredMessage(
        id=message_id,
        tenant_id=1,
        component_id=1,
        endpoint_key="e" * 32,
        recipient_key=messages.recipient_key(endpoint),
        urgency=2,
        received=now,
        expires=now + timedelta(seconds=ttl),
        endpoint_expires=now + timedelta(days=7),
        size=len(body),
        ttl=ttl,
        attempts=0,
        sealed=messages.seal_message(endpoint, body),
    )


def answer(iq_id: str, sender: str, condition: str | None = None) -> ET.Element:
    ns = "jabber:component:accept"
    iq = ET.Element(
        f"{{{ns}}}iq", {"type": "error" if condition else "result", "id": iq_id, "from": sender}
    )
    if condition:
        error = ET.SubElement(iq, f"{{{ns}}}error", {"type": "cancel"})
        ET.SubElement(error, f"{{urn:ietf:params:xml:ns:xmpp-stanzas}}{condition}")
    return iq


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_push_iq_carries_the_body_to_the_full_jid():
    async def scenario():
        relay, wire = UnifiedPushRelay(no_database), Wire()
        relay.link_up(1, "up.example.org", wire)
        await relay._index()  # as the first sweep after a link comes up
        relay.consider(stored(7, b"\x00body"))
        relay.consider(stored(7, b"\x00body"))  # known: not twice
        await asyncio.sleep(0)  # pushes leave at the end of the loop's turn
        return wire.sent

    [sent] = run(scenario())
    iq = ET.fromstring(sent)
    assert iq.get("to") == JID and iq.get("from") == "up.example.org" and iq.get("type") == "set"
    push = iq.find(f"{{{UP_NS}}}push")
    assert base64.b64decode(push.text) == b"\x00body"
    assert base64.b64decode(push.get("application")) == b"a" * 32


def test_only_the_phone_itself_can_answer_and_a_failure_holds_it_back():
    async def scenario():
        relay, wire = UnifiedPushRelay(no_database, retry_base=60, retry_max=60), Wire()
        relay.link_up(1, "up.example.org", wire)
        await relay._index()  # as the first sweep after a link comes up
        message = stored(8)
        relay.consider(message)
        await asyncio.sleep(0)
        iq_id = ET.fromstring(wire.sent[0]).get("id")
        assert relay.on_iq_answer(1, answer(iq_id, "mallory@example.com/x"))
        assert iq_id in relay.in_flight  # still waiting for the phone
        assert relay.on_iq_answer(1, answer(iq_id, JID, "service-unavailable"))
        await asyncio.sleep(0)
        relay.consider(stored(9))  # the same phone: held back now
        return relay, wire

    relay, wire = run(scenario())
    assert len(wire.sent) == 1
    assert len(relay.phones.away) == 1 and not relay.in_flight


def test_a_stale_read_of_a_delivered_message_does_not_send_it_again():
    """A sweep or flush that read the row before its delete comes back after it."""

    finished: list[int] = []

    async def database(fn, *args, **kwargs):
        if fn.__name__ == "finish":
            finished.extend(kwargs["ids"])
        return await no_database(fn, *args, **kwargs)

    async def scenario():
        relay, wire = UnifiedPushRelay(database), Wire()
        relay.link_up(1, "up.example.org", wire)
        await relay._index()  # as the first sweep after a link comes up
        message = stored(10)
        relay.consider(message)
        await asyncio.sleep(0)
        iq_id = ET.fromstring(wire.sent[0]).get("id")
        assert relay.on_iq_answer(1, answer(iq_id, JID))  # delivered
        # The finish window passes, the row is deleted.
        await async_wait_until(lambda: finished == [10], what="the delivered row is deleted")
        relay.consider(message, flush=True)  # what the stale read returned
        await asyncio.sleep(0)
        return wire.sent

    assert len(run(scenario())) == 1


def test_answers_to_unknown_ids_are_left_to_slixmpp():
    relay = UnifiedPushRelay(no_database)
    assert relay.on_iq_answer(1, answer("someone-elses", JID)) is False


def test_phones_that_never_come_back_are_forgotten():
    relay = UnifiedPushRelay(no_database, retry_max=10)
    relay.phones.away[(1, "old")] = Recipient(failures=3, retry_at=time.monotonic() - 100)
    relay.phones.away[(1, "recent")] = Recipient(failures=1, retry_at=time.monotonic() + 5)
    relay._forget_old_recipients()
    assert list(relay.phones.away) == [(1, "recent")]


def offered(message: StoredMessage) -> NewMessage:
    """The message as a web process offers it on the direct path."""
    return NewMessage(
        tenant_id=message.tenant_id,
        component_id=message.component_id,
        endpoint_key=message.endpoint_key,
        recipient_key=message.recipient_key,
        topic_key="",
        urgency=message.urgency,
        received=message.received,
        expires=message.expires,
        endpoint_expires=message.endpoint_expires,
        size=message.size,
        ttl=message.ttl,
        sealed=message.sealed,
    )


def test_an_offer_is_sent_and_answered_when_the_phone_took_it():
    recorded: list[str] = []

    async def database(fn, *args, **kwargs):
        if fn.__name__ == "record":
            recorded.extend(record.outcome for record in args[0])
        return await no_database(fn, *args, **kwargs)

    async def scenario():
        relay, wire = UnifiedPushRelay(database, direct_window=5), Wire()
        relay.link_up(1, "up.example.org", wire)
        before_index = relay.offer(offered(stored(1)))
        await relay._index()
        verdict = relay.offer(offered(stored(2, b"now")))
        await asyncio.sleep(0)
        [sent] = wire.sent
        iq = ET.fromstring(sent)
        assert base64.b64decode(iq.find(f"{{{UP_NS}}}push").text) == b"now"
        assert not verdict.done()
        relay.on_iq_answer(1, answer(iq.get("id"), "mallory@example.com/x"))  # not the phone
        assert not verdict.done()
        relay.on_iq_answer(1, answer(iq.get("id"), JID))
        result = before_index.result(), await verdict
        # Written in the next batch of delivery records (in a moment, or late on a busy machine).
        await async_wait_until(lambda: recorded, what="the delivery is recorded")
        return result

    before_index, verdict = run(scenario())
    assert before_index == ("N", None)  # which phones have stored messages is not known yet
    assert verdict == ("D", None)
    assert recorded == ["delivered"]


def test_an_offer_never_overtakes_a_stored_message_or_reaches_a_revoked_endpoint():
    async def scenario():
        relay, wire = UnifiedPushRelay(no_database, direct_window=5), Wire()
        relay.link_up(1, "up.example.org", wire)
        await relay._index()
        relay.index.mark((1, stored(5).recipient_key), 5)  # a stored message, as read
        behind_stored = relay.offer(offered(stored(6)))
        relay.index.revoked.add("e" * 32)
        revoked = relay.offer(offered(stored(7)))
        await asyncio.sleep(0)
        return behind_stored.result(), revoked.result(), wire.sent

    behind_stored, revoked, sent = run(scenario())
    assert behind_stored == ("N", None)
    assert revoked == ("R", None)
    assert sent == []


def test_pushes_ready_in_one_turn_of_the_loop_leave_in_one_write():
    async def scenario():
        relay, wire = UnifiedPushRelay(no_database), Wire()
        relay.link_up(1, "up.example.org", wire)
        await relay._index()
        relay.consider(stored(21, b"one"))
        relay.consider(stored(22, b"two"), flush=True)
        await asyncio.sleep(0)
        relay.consider(stored(23, b"three"), flush=True)
        await asyncio.sleep(0)
        return wire.sent

    first, second = run(scenario())
    pushes = ET.fromstring(b"<wire>" + first + b"</wire>").findall("iq")
    bodies = [base64.b64decode(iq.find(f"{{{UP_NS}}}push").text) for iq in pushes]
    assert bodies == [b"one", b"two"]
    assert base64.b64decode(ET.fromstring(second).find(f"{{{UP_NS}}}push").text) == b"three"
