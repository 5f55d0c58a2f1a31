"""UnifiedPush in the gateway: the register iq, and relaying stored messages to phones.

The web process stores each POST (`relay.unifiedpush.services.store`) and wakes us: on
PostgreSQL with NOTIFY (the payload carries the sealed message, so nothing is read back), and
on every database with a periodic sweep for messages that are due (the only wake-up on
SQLite, hence a short interval there). We send each message as `<push>` iq on the link of its
component, straight onto the transport (no slixmpp stanza objects on this path), and the
phone's answer (caught before slixmpp builds a stanza, see `PushComponent`) decides:

- `result`: delivered; deleted in batches (one statement per few milliseconds).
- `item-not-found`, `feature-not-implemented`: the endpoint is revoked.
- anything else, or no answer within UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS: the phone is away.
  It gets nothing more until a retry with backoff (the oldest message first, as a probe),
  a directed presence, or a new registration shows it is back; then everything stored for
  it goes out, oldest first. A late `result` to a timed-out push still counts as delivered.

State here is only a cache: after a restart the sweep finds every stored message again. Its
parts: `phones` (who is held back, until when), `index` (what the direct path must not
overtake), `wire` (the push iq, a link's writes, batched database writes), `channel` (the
direct path's listener).

With several gateways, each sends only over the links it holds (`links`, filled when a link's
session starts and emptied when it ends or its lease is lost): NOTIFY reaches every gateway,
but only the lease holder of a message's component has it in `links`, and the sweep asks
only for those components. A push in flight when a link moves is sent again by the new
holder (at least once, as after a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import xml.etree.ElementTree as ET
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection
from slixmpp.jid import JID

from relay import conf
from relay.models import Component
from relay.unifiedpush.gateway.channel import ChannelServer
from relay.unifiedpush.gateway.index import StoredIndex
from relay.unifiedpush.gateway.phones import PhoneKey, Phones
from relay.unifiedpush.gateway.wire import Batch, Link, error_condition
from relay.unifiedpush.models import UnifiedPushOutcome, serves
from relay.unifiedpush.services import UP_NS, channel, delivery, messages, registration, store
from relay.unifiedpush.services.delivery import Fate
from relay.unifiedpush.services.keys import Unsealable
from relay.unifiedpush.services.store import DeliveryRecord, NewMessage, StoredMessage
from xmppgateway import handlers
from xmppgateway.features import Sender
from xmppgateway.handlers import Answer, LinkContext, RunBlocking, Unavailable

log = logging.getLogger(__name__)

REGISTER_TAG = f"{{{UP_NS}}}register"

MAX_IN_FLIGHT = 5000  # pushes awaiting an answer, all links; beyond, the sweep sends later
LATE_ANSWERS = 10_000  # timed-out pushes whose late `result` still counts
# A finished message stays known this long after its row is gone: a sweep or flush that read
# it before the delete may still come back with it, and must not send it again.
FORGET_FINISHED_SECONDS = 120.0
SWEEP_LIMIT = 1000
EXPIRY_SECONDS = 5.0
RECORDS_MAX = 100_000  # direct-path delivery records awaiting a database that is down


@dataclass(slots=True)
class InFlight:
    message: StoredMessage
    jid: str
    sent: float


@dataclass(slots=True)
class Direct:
    """A message offered by a web process, sent, and not yet answered by the phone."""

    message: NewMessage
    jid: str
    verdict: asyncio.Future[tuple[str, int | None]]
    timer: asyncio.TimerHandle | None = None
    storing: bool = False
    answer: Fate | None = None  # an answer that came while it was being stored


def _listen_params() -> dict[str, Any]:
    params = dict(connection.get_connection_params())
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    return params


@dataclass
class UnifiedPushRelay:
    """Every link's UnifiedPush traffic, in the gateway's event loop (no locks needed)."""

    run_blocking: RunBlocking
    answer_timeout: float = field(
        default_factory=lambda: conf.current().unifiedpush_answer_timeout_seconds
    )
    retry_base: float = field(default_factory=lambda: conf.current().unifiedpush_retry_base_seconds)
    retry_max: float = field(default_factory=lambda: conf.current().unifiedpush_retry_max_seconds)
    sweep_seconds: float = field(default_factory=lambda: conf.current().unifiedpush_sweep_seconds)
    links: dict[int, Link] = field(default_factory=dict)
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    late: OrderedDict[str, InFlight] = field(default_factory=OrderedDict)
    known: set[int] = field(default_factory=set)
    phones: Phones = field(default_factory=Phones)
    index: StoredIndex = field(default_factory=StoredIndex)
    _finishes: Batch[tuple[str, int]] = field(init=False)
    _sweep_wanted: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _last_expiry: float = 0.0
    _stopping: bool = False
    # The direct path: offered messages awaiting the phone.
    direct_window: float = field(default_factory=lambda: conf.current().unifiedpush_direct_seconds)
    direct: dict[str, Direct] = field(default_factory=dict)
    _direct_count: int = 0
    _records: Batch[DeliveryRecord] = field(init=False)
    _channel_server: ChannelServer | None = None

    def __post_init__(self) -> None:
        self._finishes = Batch(self._write_finishes)
        self._records = Batch(lambda records: self._spawn(self._write_records(records)))

    # --- plugged into the gateway (xmppgateway.features)

    def iq_set_handlers(self) -> dict[str, handlers.IqHandler]:
        return {REGISTER_TAG: self.register}

    def disco_features(self, component: Component) -> list[str]:
        return [UP_NS] if serves(component) else []

    async def start(self) -> str:
        """The direct path's listener (`gateway.channel`), announced with the gateway's
        leases; a gateway that cannot listen still relays, every message through the store."""
        if self.direct_window <= 0:
            return ""
        bind = channel.parse_bind(conf.current().unifiedpush_channel)  # checked (relay.E012)
        if bind is None:
            return ""
        server = ChannelServer(bind, self.offer)
        try:
            await server.start()
        except OSError as error:
            log.error("unifiedpush.channel_failed", extra={"error_type": type(error).__name__})
            return ""
        self._channel_server = server
        return server.address

    async def stop(self) -> None:
        if self._channel_server is not None:
            await self._channel_server.stop()

    def link_up(self, component_id: int, component_jid: str, sender: Sender) -> None:
        self.links[component_id] = Link(sender, component_jid)
        self._sweep_wanted.set()

    def link_down(self, component_id: int) -> None:
        """Answers cannot come over a dead link: its pushes go out again once it is back."""
        self.links.pop(component_id, None)
        self.index.link_down(component_id)
        for iq_id, entry in list(self.in_flight.items()):
            if entry.message.component_id == component_id:
                del self.in_flight[iq_id]
                self.known.discard(entry.message.id)
        for iq_id, direct in list(self.direct.items()):
            if direct.message.component_id == component_id and not direct.storing:
                self._direct_unanswered(iq_id)

    async def run(self, stopped: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self._sweep_loop(), name="unifiedpush-sweep")]
        if connection.vendor == "postgresql":
            tasks.append(asyncio.create_task(self._listen_loop(), name="unifiedpush-listen"))
        try:
            await stopped.wait()
        finally:
            self._stopping = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for iq_id, direct in list(self.direct.items()):
                if not direct.storing:  # no answer can wait for us: stored, then answered
                    self._direct_unanswered(iq_id)
            await self._drain_finishes()

    # --- the register iq

    async def register(self, ctx: LinkContext, sender: JID, element: ET.Element) -> Answer:
        if not serves(ctx.component):
            return handlers.error(*handlers.SERVICE_UNAVAILABLE)
        try:
            registered = await ctx.run_blocking(
                registration.register,
                component_id=ctx.component.pk,
                jid=str(sender),
                domain=sender.domain,
                has_resource=bool(sender.resource and sender.user),
                application=element.get("application"),
                instance=element.get("instance"),
                now=time.time(),
            )
        except registration.Refused as refused:
            return handlers.error(
                refused.refusal.condition, refused.refusal.error_type, refused.text
            )
        except Unavailable:
            return handlers.error(*handlers.TRY_LATER)
        self.recipient_back(ctx.component.pk, registered.recipient_jid)
        reply = ET.Element(
            f"{{{UP_NS}}}registered",
            {"endpoint": registered.endpoint, "expiration": registered.expiration},
        )
        return Answer(reply)

    # --- stanzas caught before slixmpp (PushComponent)

    def on_iq_answer(self, component_id: int, iq: ET.Element) -> bool:
        """A result or error iq: True when it answered one of our pushes."""
        iq_id = iq.get("id", "")
        direct = self.direct.get(iq_id)
        if direct is not None:
            if iq.get("from") == direct.jid and direct.message.component_id == component_id:
                self._direct_answered(iq_id, delivery.fate(iq.get("type", ""), error_condition(iq)))
            return True
        entry = self.in_flight.pop(iq_id, None)
        late = False
        if entry is None:
            entry = self.late.pop(iq_id, None)
            late = entry is not None
        if entry is None:
            return False
        if iq.get("from") != entry.jid or entry.message.component_id != component_id:
            # Not from the phone we sent it to: ignore it, keep waiting for the real answer.
            (self.late if late else self.in_flight)[iq_id] = entry
            return True
        outcome = delivery.fate(iq.get("type", ""), error_condition(iq))
        message = entry.message
        key = (component_id, message.recipient_key)
        # Known until its row is gone: a flush or sweep meanwhile must not send it again.
        self.known.add(message.id)
        if outcome is Fate.DELIVERED:
            self._finish_later(message.id, UnifiedPushOutcome.DELIVERED)
            if self.phones.back([key]):
                self._flush_soon(component_id, [message.recipient_key])
        elif outcome is Fate.REVOKED:
            self._spawn(self._revoke(message))
        elif not late:
            self._failed(message)
        else:
            self.known.discard(message.id)  # a late error: it stays stored, retried later
        return True

    def on_presence(self, component_id: int, presence: ET.Element) -> bool:
        """Directed presence from a phone: available flushes what is stored for it."""
        presence_type = presence.get("type")
        if presence_type not in (None, "unavailable"):
            return False
        sender = presence.get("from", "")
        if "/" not in sender or "@" not in sender.split("/", 1)[0]:
            return False
        if presence_type is None:
            self.recipient_back(component_id, sender)
        else:
            for key in messages.recipient_keys(sender):
                self.phones.went_away((component_id, key), hold=self.retry_max)
        return True

    def recipient_back(self, component_id: int, jid: str) -> None:
        keys = messages.recipient_keys(jid)
        self.phones.back((component_id, key) for key in keys)
        self._flush_soon(component_id, keys)

    # --- sending

    def consider(self, message: StoredMessage, *, flush: bool = False) -> None:
        """Send a stored message now if its phone and link allow it; otherwise it waits."""
        if message.id in self.known:
            return
        key = (message.component_id, message.recipient_key)
        self.index.seen_stored(key, message.id)
        link = self.links.get(message.component_id)
        if link is None or len(self.in_flight) >= MAX_IN_FLIGHT:
            return
        state = self.phones.away.get(key)
        if self.phones.held(key) and not flush:
            if datetime.now(UTC) >= message.expires:
                # Its TTL ran out while the phone was away (TTL 0: the phone is away now,
                # RFC 8030 5.2): never delivered later, even if the phone is back in a moment.
                self.known.add(message.id)
                self._finish_later(message.id, UnifiedPushOutcome.EXPIRED)
            return
        if not flush:
            if message.component_id not in self.index.indexed:
                return  # the sweep after the index sends it, behind what it must not overtake
            if self.index.older_waiting(key, message.id, self.known):
                # Older messages of this phone wait. In backoff, this one waits behind them (it
                # may come due a moment before the probe); with no backoff known (a restart
                # forgot it), all of them go now, oldest first.
                if state is None:
                    self._flush_soon(message.component_id, [message.recipient_key])
                return
        now = datetime.now(UTC)
        if not delivery.sendable(message, now, backlog=flush):
            self.known.add(message.id)
            self._finish_later(message.id, UnifiedPushOutcome.EXPIRED)
            return
        try:
            opened = messages.open_message(message.sealed)
        except (Unsealable, ValueError):
            log.error("unifiedpush.unsealable", extra={"component_id": message.component_id})
            return
        if state is not None and not flush:
            state.probing = True
        iq_id = f"up{message.id}.{message.attempts}"
        self.in_flight[iq_id] = InFlight(message, opened.jid, time.monotonic())
        self.known.add(message.id)
        link.push(iq_id, opened)

    def on_notify(self, payload: str) -> None:
        """One notification per stored batch: a line per message, in the order stored."""
        too_big = []
        for line in payload.split("\n"):
            try:
                parsed = store.parse_notify_payload(line)
            except (ValueError, IndexError):
                log.error("unifiedpush.bad_notification")
                continue
            if isinstance(parsed, int):
                too_big.append(parsed)
            else:
                self.consider(parsed)
        if too_big:
            self._spawn(self._send_by_ids(too_big))

    async def _send_by_ids(self, ids: list[int]) -> None:
        with contextlib.suppress(Unavailable):
            for message in await self.run_blocking(store.by_ids, ids):
                self.consider(message)

    def _flush_soon(self, component_id: int, recipient_keys: list[str]) -> None:
        if component_id in self.links:
            self._spawn(self._flush(component_id, recipient_keys))

    async def _flush(self, component_id: int, recipient_keys: list[str]) -> None:
        """Send everything stored for a phone, oldest first; what was marked before the read
        and is no longer stored ended elsewhere (replaced, withdrawn, expired): unmarked."""
        marked = self.index.marked(component_id, recipient_keys)
        try:
            stored = await self.run_blocking(
                store.for_recipient, component_id=component_id, recipient_keys=recipient_keys
            )
        except Unavailable:
            return  # the sweep finds them later
        for message_id in marked - {message.id for message in stored}:
            self.index.unmark(message_id)
        for message in stored:
            self.consider(message, flush=True)

    # --- the direct path (relay/unifiedpush/services/channel.py)

    def offer(self, message: NewMessage) -> asyncio.Future[tuple[str, int | None]]:
        """A web process offers a message: sent now, its verdict once the phone answered (or
        it was stored); or declined at once, and the web process stores it. Declined whenever
        sending now could overtake a stored message of the phone."""
        verdict: asyncio.Future[tuple[str, int | None]] = asyncio.get_running_loop().create_future()
        refusal = self._send_direct(message, verdict)
        if refusal is not None:
            verdict.set_result((refusal, None))
        return verdict

    def _send_direct(
        self, message: NewMessage, verdict: asyncio.Future[tuple[str, int | None]]
    ) -> str | None:
        link = self.links.get(message.component_id)
        if (
            link is None
            or self._stopping
            or self.direct_window <= 0
            or message.component_id not in self.index.indexed
        ):
            return channel.NOT_HERE
        if message.endpoint_key in self.index.revoked:
            return channel.REVOKED
        key = (message.component_id, message.recipient_key)
        if message.ttl == 0 and self.phones.in_backoff(key):
            # The phone is away: RFC 8030 5.2, a zero TTL expires and is never delivered.
            self._record_later(message, UnifiedPushOutcome.EXPIRED, answered=False)
            return channel.EXPIRED
        if (
            self.index.holds(key)
            or key in self.phones.away
            or len(self.in_flight) + len(self.direct) >= MAX_IN_FLIGHT
        ):
            # What the web process stores now must not be overtaken either, even before its
            # wake-up reaches us: the phone stays on the stored path until we saw it stored.
            self.index.declined(key)
            return channel.NOT_HERE
        try:
            opened = messages.open_message(message.sealed)
        except (Unsealable, ValueError):
            log.error("unifiedpush.unsealable", extra={"component_id": message.component_id})
            return channel.NOT_HERE
        self._direct_count += 1
        iq_id = f"ud{self._direct_count}"
        entry = Direct(message, opened.jid, verdict)
        entry.timer = verdict.get_loop().call_later(
            self.direct_window, self._direct_unanswered, iq_id
        )
        self.direct[iq_id] = entry
        link.push(iq_id, opened)
        return None

    def _direct_answered(self, iq_id: str, outcome: Fate) -> None:
        entry = self.direct[iq_id]
        if entry.storing:
            entry.answer = outcome  # applied once the row exists
            return
        if entry.timer is not None:
            entry.timer.cancel()
        if outcome is Fate.DELIVERED:
            del self.direct[iq_id]
            self._record_later(entry.message, UnifiedPushOutcome.DELIVERED)
            _settle(entry, channel.DELIVERED)
        elif outcome is Fate.REVOKED:
            entry.storing = True
            self._spawn(self._direct_revoke(iq_id))
        else:
            self._direct_store(iq_id, answered=True)

    def _direct_unanswered(self, iq_id: str) -> None:
        """No answer within the window (or the link or gateway goes): stored, then answered."""
        entry = self.direct.get(iq_id)
        if entry is None or entry.storing:
            return
        if entry.timer is not None:
            entry.timer.cancel()
        self._direct_store(iq_id, answered=False)

    def _direct_store(self, iq_id: str, *, answered: bool) -> None:
        entry = self.direct[iq_id]
        entry.storing = True
        if entry.message.ttl == 0:  # RFC 8030: deliver now or never; never kept
            del self.direct[iq_id]
            self._record_later(entry.message, UnifiedPushOutcome.EXPIRED, answered=answered)
            _settle(entry, channel.EXPIRED)
            return
        self._spawn(self._store_direct(iq_id, answered=answered))

    async def _store_direct(self, iq_id: str, *, answered: bool) -> None:
        entry = self.direct[iq_id]
        message = entry.message
        # Not due while its answer may still come: the sweep must not send it again meanwhile.
        pending = None if answered else datetime.now(UTC) + timedelta(seconds=self.answer_timeout)
        try:
            message_id = await self.run_blocking(
                store.store,
                dataclasses.replace(message, notify=False, next_attempt=pending),
                max_per_endpoint=conf.current().unifiedpush_max_stored_per_endpoint,
            )
        except Exception as error:  # the database is down: the web process tries the store
            log.warning(
                "unifiedpush.direct_store_failed", extra={"error_type": type(error).__name__}
            )
            del self.direct[iq_id]
            _settle(entry, channel.FAILED)
            return
        del self.direct[iq_id]
        if message_id is None:  # revoked meanwhile (another link holder's answer)
            self.index.note_revoked(message.endpoint_key)
            _settle(entry, channel.REVOKED)
            return
        stored = _as_stored(message, message_id)
        self.index.mark((message.component_id, message.recipient_key), message_id)
        self.known.add(message_id)
        _settle(entry, channel.STORED, message_id)
        outcome = entry.answer
        if outcome is Fate.DELIVERED:
            self._finish_later(message_id, UnifiedPushOutcome.DELIVERED)
        elif outcome is Fate.REVOKED:
            await self._revoke(stored)
        elif answered or outcome is not None:
            self._failed(stored)
        else:
            self.in_flight[iq_id] = InFlight(stored, entry.jid, time.monotonic())

    async def _direct_revoke(self, iq_id: str) -> None:
        entry = self.direct.pop(iq_id)
        message = entry.message
        try:
            await self.run_blocking(
                store.revoke,
                endpoint_key=message.endpoint_key,
                tenant_id=message.tenant_id,
                until=message.endpoint_expires,
                now=datetime.now(UTC),
            )
        except Exception as error:  # stored by the web process; refused again when re-sent
            log.warning(
                "unifiedpush.direct_revoke_failed", extra={"error_type": type(error).__name__}
            )
            _settle(entry, channel.FAILED)
            return
        self.index.note_revoked(message.endpoint_key)
        self._record_later(message, UnifiedPushOutcome.REVOKED)
        log.info("unifiedpush.revoked", extra={"component_id": message.component_id})
        _settle(entry, channel.REVOKED)

    def _record_later(self, message: NewMessage, outcome: str, *, answered: bool = True) -> None:
        if len(self._records.items) >= RECORDS_MAX:
            log.error("unifiedpush.records_dropped", extra={"outcome": outcome})
            return
        self._records.add(
            DeliveryRecord(
                tenant_id=message.tenant_id,
                component_id=message.component_id,
                outcome=outcome,
                urgency=message.urgency,
                received=message.received,
                finished=datetime.now(UTC),
                size=message.size,
                ttl=message.ttl,
                attempts=1 if answered else 0,
            )
        )

    async def _write_records(self, records: list[DeliveryRecord]) -> None:
        try:
            await self.run_blocking(store.record, records)
        except Exception as error:  # kept for the next batch (the push itself was delivered)
            log.warning("unifiedpush.records_failed", extra={"error_type": type(error).__name__})
            if self._stopping:
                log.error("unifiedpush.records_lost", extra={"records": len(records)})
                return
            await asyncio.sleep(1.0)
            self._records.items[:0] = records[: RECORDS_MAX - len(self._records.items)]
            self._records.flush()

    # --- what the direct path must respect (index.py)

    def _settled(self, keys: Iterable[PhoneKey]) -> None:
        """After messages of these phones ended: a phone whose remaining marks are none we
        sent (a message replaced, withdrawn or expired meanwhile, which nobody tells us) is
        read again, so it is back on the direct path as soon as its stored messages are out,
        not at the next index."""
        for key in keys:
            if key not in self.phones.away and self.index.only_ended_elsewhere(key, self.known):
                self._flush_soon(key[0], [key[1]])

    async def _index(self) -> None:
        """Read which phones have stored messages, and the revocations, again: the direct
        path opens for a component only once this has run since its link came up."""
        component_ids = list(self.links)
        self.index.begin_read()
        try:
            rows = await self.run_blocking(store.stored_index, component_ids)
            revoked = await self.run_blocking(store.revoked_keys, now=datetime.now(UTC))
        except Unavailable:
            self.index.abandon_read()
            return
        self.index.finish_read(rows, revoked, component_ids=component_ids, held=self.links)

    # --- outcomes

    def _failed(self, message: StoredMessage, *, answered: bool = True) -> None:
        """The phone did not take it. Unanswered, the push most likely waits in a hibernated
        session on the phone's server, which answers it on resumption (or bounces it when the
        session dies): sending it again soon would only queue a duplicate, so the retry then
        waits the longest backoff; a late answer, presence or registration comes first."""
        state = self.phones.failed((message.component_id, message.recipient_key))
        delay = delivery.retry_delay(state.failures, base=self.retry_base, maximum=self.retry_max)
        if not answered:
            delay = self.retry_max
        now = datetime.now(UTC)
        if message.expires <= now:
            self._finish_later(message.id, UnifiedPushOutcome.EXPIRED)
            return
        # Deliverable until its TTL passes: the phone's return (presence, registration, a
        # late answer) brings it out meanwhile, and a retry never waits beyond its expiry.
        until = min(now + timedelta(seconds=delay), message.expires)
        state.retry_at = time.monotonic() + (until - now).total_seconds()
        self.known.discard(message.id)
        self._spawn(self._postpone(message, until))

    async def _postpone(self, message: StoredMessage, until: datetime) -> None:
        with contextlib.suppress(Unavailable):
            await self.run_blocking(
                store.postpone,
                component_id=message.component_id,
                recipient_key=message.recipient_key,
                failed_ids=[message.id],
                until=until,
            )

    async def _revoke(self, message: StoredMessage) -> None:
        try:
            ended = await self.run_blocking(
                store.revoke,
                endpoint_key=message.endpoint_key,
                tenant_id=message.tenant_id,
                until=message.endpoint_expires,
                now=datetime.now(UTC),
            )
        except Unavailable:
            self.known.discard(message.id)  # retried later; the phone will refuse it again
            return
        self.index.note_revoked(message.endpoint_key)
        self.known.discard(message.id)
        self.index.unmark(message.id)
        self._settled([(message.component_id, message.recipient_key)])
        log.info(
            "unifiedpush.revoked",
            extra={"component_id": message.component_id, "messages_ended": ended},
        )

    def _finish_later(self, message_id: int, outcome: str) -> None:
        self._finishes.add((outcome, message_id))

    def _write_finishes(self, finishes: list[tuple[str, int]]) -> None:
        by_outcome: dict[str, list[int]] = {}
        for outcome, message_id in finishes:
            by_outcome.setdefault(outcome, []).append(message_id)
        for outcome, ids in by_outcome.items():
            self._spawn(self._finish(outcome, ids))

    async def _finish(self, outcome: str, ids: list[int]) -> None:
        try:
            await self.run_blocking(
                store.finish,
                ids=ids,
                outcome=outcome,
                now=datetime.now(UTC),
                answered=outcome == UnifiedPushOutcome.DELIVERED,
            )
        except Exception as error:  # the database is down: keep them, try again shortly
            log.warning("unifiedpush.finish_failed", extra={"error_type": type(error).__name__})
            if self._stopping:
                return  # still stored: sent again after the restart (at least once)
            await asyncio.sleep(1.0)
            for message_id in ids:
                self._finish_later(message_id, outcome)
            return
        keys = {key for message_id in ids if (key := self.index.unmark(message_id)) is not None}
        asyncio.get_running_loop().call_later(
            FORGET_FINISHED_SECONDS, self.known.difference_update, ids
        )
        self._settled(keys)

    async def _drain_finishes(self) -> None:
        pending = [task for task in self._tasks if not task.done()]
        if pending:  # direct messages being stored, revocations
            await asyncio.wait(pending, timeout=5.0)
        self._finishes.flush()
        self._records.flush()
        pending = [task for task in self._tasks if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=5.0)

    # --- background

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _check_timeouts(self) -> None:
        deadline = time.monotonic() - self.answer_timeout
        expired = []
        for iq_id, entry in self.in_flight.items():
            if entry.sent > deadline:
                break  # sent in order: the rest are younger
            expired.append(iq_id)
        for iq_id in expired:
            entry = self.in_flight.pop(iq_id)
            self.late[iq_id] = entry
            self._failed(entry.message, answered=False)
        while len(self.late) > LATE_ANSWERS:
            self.late.popitem(last=False)

    def _forget_old_recipients(self) -> None:
        self.phones.forget_older_than(time.monotonic() - 2 * self.retry_max)

    async def _sweep(self) -> None:
        self._check_timeouts()
        self._forget_old_recipients()
        if self.index.due(self.links):
            await self._index()
        now = datetime.now(UTC)
        if time.monotonic() - self._last_expiry > EXPIRY_SECONDS:
            self._last_expiry = time.monotonic()
            with contextlib.suppress(Unavailable):
                await self.run_blocking(
                    store.expire, now=now, grace=timedelta(seconds=self.answer_timeout)
                )
        component_ids = list(self.links)
        if not component_ids:
            return
        try:
            due = await self.run_blocking(
                store.due, component_ids=component_ids, now=now, limit=SWEEP_LIMIT
            )
        except Unavailable:
            return
        for message in due:
            self.consider(message)

    async def _sweep_loop(self) -> None:
        while not self._stopping:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can turn a cancellation
            # that meets its own timeout into a TimeoutError, and the loop would never end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.sweep_seconds):
                    await self._sweep_wanted.wait()
            self._sweep_wanted.clear()
            try:
                await self._sweep()
            except Exception as error:  # a bug must not stop the safety net
                log.exception(
                    "unifiedpush.sweep_crashed", extra={"error_type": type(error).__name__}
                )

    async def _listen_loop(self) -> None:
        import psycopg

        delay = 0.5
        while not self._stopping:
            try:
                params = _listen_params()
                conn = await psycopg.AsyncConnection.connect(**params, autocommit=True)
                async with conn:
                    await conn.execute(f"LISTEN {store.CHANNEL}")
                    log.info("unifiedpush.listening")
                    delay = 0.5
                    self._sweep_wanted.set()  # whatever came while we did not listen
                    async for notification in conn.notifies():
                        self.on_notify(notification.payload)
            except (psycopg.Error, OSError) as error:
                log.warning("unifiedpush.listen_lost", extra={"error_type": type(error).__name__})
            await asyncio.sleep(delay)
            delay = min(10.0, delay * 2)


def _settle(entry: Direct, verdict: str, message_id: int | None = None) -> None:
    if not entry.verdict.done():  # its web process may have gone meanwhile
        entry.verdict.set_result((verdict, message_id))


def _as_stored(message: NewMessage, message_id: int) -> StoredMessage:
    return StoredMessage(
        id=message_id,
        tenant_id=message.tenant_id,
        component_id=message.component_id,
        endpoint_key=message.endpoint_key,
        recipient_key=message.recipient_key,
        urgency=message.urgency,
        received=message.received,
        expires=message.expires,
        endpoint_expires=message.endpoint_expires,
        size=message.size,
        ttl=message.ttl,
        attempts=0,
        sealed=message.sealed,
    )
