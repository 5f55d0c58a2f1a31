"""The gateway process: every enabled component link in one asyncio loop.

slixmpp neither reconnects after a stream error or a server restart nor reports a wrong
secret beyond one event, so each link runs under a supervisor loop here. A link that was up
(the handshake passed) comes back after the shortest delay, however often it dropped: a drop
caused by bad input is not a reason to wait. The delay grows only while connecting fails
(refused, wrong secret). The set of links follows the database: added, changed, disabled and
deleted components are picked up by polling, without a restart.

Several gateways may run: each link is held by the one holding its lease
(relay.services.link_leases). Each poll is also a lease round (renew, heartbeat, take free
leases up to a fair share); a watchdog drops any link whose lease this gateway could no
longer be sure of, before another gateway can take it. On SIGTERM the links close and the
leases are released at once, so the others take over at their next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import Error as DatabaseError
from django.db import close_old_connections, connections

from relay import conf
from relay.models import Component, LinkState
from relay.probes import ProbeServer
from relay.services import (
    delivery_journal,
    direct_sends,
    health,
    link_leases,
    links,
    provider_registry,
    publishing,
    tallies,
)
from relay.services.delivery_journal import Journal
from relay.services.publishing import Publish, Verdict
from relay.services.queue import QueueUnavailable
from xmppgateway import features
from xmppgateway.component import PushComponent
from xmppgateway.handlers import RunBlocking, Unavailable
from xmppgateway.stream import StreamLimits

log = logging.getLogger(__name__)

# A link given up to another gateway waits this long for its requests in flight.
SHED_GRACE_SECONDS = 2.0
# Closing a link after that grace takes at most this long (xmpp.disconnect below).
CLOSE_SECONDS = 2.5
# How often a gateway that keeps no journal of its own looks for those of gateways gone.
ORPHANS_ONLY_SECONDS = 1.0
# How often the watchdog compares the held links with their lease deadlines (seconds).
WATCHDOG_SECONDS = 0.2


def _link_key(component: Component) -> tuple[Any, ...]:
    return (component.jid, component.secret, component.host, component.port, component.app_id)


class Link:
    """Keeps one component connected until stopped."""

    def __init__(self, gateway: Gateway, component: Component) -> None:
        self.gateway = gateway
        self.component = component
        self.key = _link_key(component)
        self.xmpp: PushComponent | None = None
        self.up = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._report: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"link-{self.component.pk}")

    async def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        xmpp = self.xmpp
        if xmpp is not None and xmpp.in_flight:
            await asyncio.wait(set(xmpp.in_flight), timeout=grace)
        if xmpp is not None:
            xmpp.cancel_connection_attempt()
            if xmpp.transport is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(xmpp.disconnect(wait=1.0), timeout=2.0)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.gateway.report(self.component, LinkState.DOWN, "")

    def drop(self) -> None:
        """Cut the link now, no goodbye: its lease may run out before a graceful close ends.
        The features stop sending over it at once; `stop()` still has to be awaited."""
        self._stopping = True
        for feature in self.gateway.features:
            feature.link_down(self.component.pk)
        xmpp = self.xmpp
        if xmpp is not None:
            xmpp.cancel_connection_attempt()
            if xmpp.transport is not None:
                xmpp.abort()

    async def _run(self) -> None:
        minimum = conf.current().reconnect_min_seconds
        maximum = conf.current().reconnect_max_seconds
        delay = minimum
        while not self._stopping:
            reason, was_up = await self._connect_once()
            if self._stopping:
                return
            if was_up:
                delay = minimum
            wait = random.uniform(delay / 2, delay)
            log.warning(
                "link.down",
                extra={
                    "component_id": self.component.pk,
                    "reason": reason,
                    "retry_in": round(wait, 2),
                },
            )
            await self.gateway.report(self.component, LinkState.DOWN, reason)
            await asyncio.sleep(wait)
            delay = min(maximum, delay * 2)

    def _build(
        self, plugged: list[Any], iq_set_handlers: dict[str, Callable[..., Any]]
    ) -> PushComponent:
        component_id = self.component.pk
        return PushComponent(
            self.component,
            run_blocking=self.gateway.run_blocking,
            max_field_length=conf.current().max_field_length,
            limits=StreamLimits(
                max_stanza_bytes=conf.current().max_stanza_bytes,
                max_depth=conf.current().max_stanza_depth,
            ),
            max_in_flight=conf.current().link_max_in_flight,
            accept_publish=self.gateway.publishes.accept,
            iq_set_handlers=iq_set_handlers,
            disco_features=lambda component: [
                var for feature in plugged for var in feature.disco_features(component)
            ],
            on_iq_answer=lambda xml: any(f.on_iq_answer(component_id, xml) for f in plugged),
            on_presence=lambda xml: any(f.on_presence(component_id, xml) for f in plugged),
        )

    async def _connect_once(self) -> tuple[str, bool]:
        """Connect, serve until the link ends; say why it ended and whether it was up."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str] = loop.create_future()
        stream_error: list[str] = []
        was_up = False
        plugged = self.gateway.features
        component_id = self.component.pk
        iq_set_handlers = {
            tag: handler for each in plugged for tag, handler in each.iq_set_handlers().items()
        }
        async with self.gateway.link_builds:
            xmpp = self._build(plugged, iq_set_handlers)
            await asyncio.sleep(0)  # the next link waits for the loop's next turn
        self.xmpp = xmpp

        def finish(reason: str) -> None:
            if not ended.done():
                ended.set_result(reason)

        def on_session_start(_: Any) -> None:
            nonlocal was_up
            was_up = True
            self.up.set()
            for feature in plugged:
                feature.link_up(component_id, self.component.jid, xmpp)
            log.info("link.up", extra={"component_id": self.component.pk})
            self._report = asyncio.ensure_future(
                self.gateway.report(self.component, LinkState.UP, "")
            )

        def on_stream_error(stanza: Any) -> None:
            condition = stanza["condition"] or "stream-error"
            stream_error.append(condition)
            if condition == "not-authorized":
                log.error("link.wrong_secret", extra={"component_id": self.component.pk})

        xmpp.add_event_handler("session_start", on_session_start)
        xmpp.add_event_handler("stream_error", on_stream_error)
        xmpp.add_event_handler("connection_failed", lambda e: finish("connection failed"))
        xmpp.add_event_handler("disconnected", lambda e: finish("disconnected"))
        await self.gateway.report(self.component, LinkState.CONNECTING, "")
        xmpp.connect()
        try:
            reason = await ended
        finally:
            self.up.clear()
            for feature in plugged:
                feature.link_down(component_id)
            xmpp.cancel_connection_attempt()
            if xmpp.transport is not None:
                xmpp.abort()
            await xmpp.release()
        if xmpp.closed_with:
            log.warning(
                "link.closed_on_bad_input",
                extra={"component_id": self.component.pk, "condition": xmpp.closed_with},
            )
            return f"we closed the stream: {xmpp.closed_with}", was_up
        if stream_error:
            condition = stream_error[0]
            if condition == "not-authorized":
                return "wrong secret (not-authorized)", was_up
            return condition, was_up
        return reason, was_up


class PublishBatcher:
    """Gathers the publishes of every link into `accept_publishes` calls in the executor: one
    database query, one throttling round trip and one broker message per batch instead of
    per publish.

    Two ways to gather (RELAY PUBLISH_BATCH_SECONDS, PUBLISH_BATCH_CONCURRENCY):

    - adaptive (`window` 0, `concurrency` 1 or more; the default, 1): no timer. While fewer
      than `concurrency` batch calls run, the publishes that arrived together (one read from
      the link, one turn of the event loop) go out at once; while they all run, the publishes
      gather and go out as the next batch the moment one ends. A publish at an everyday rate
      waits for nothing and the batches grow with the load. Sends reach the workers sooner
      and one by one, so a stuck provider sees more requests before its breakers open than
      with a timer (tests/test_faults_workers.py bounds how many);
    - a timer (`window` > 0): the publishes that arrive within `window` seconds of the first
      go out together, whatever else runs (`concurrency` 0: no limit).

    At most `limit` publishes a batch. Each publish still gets its own verdict, and only once
    the batch call returned, that is once its job is in the broker; a batch that fails as a
    whole answers `wait` to all.
    """

    def __init__(
        self,
        run_blocking: RunBlocking,
        *,
        limit: int,
        window: float = 0.0,
        concurrency: int = 0,
        direct: DirectPath | None = None,
    ) -> None:
        self._run_blocking = run_blocking
        self.limit = max(1, limit)
        self.window = max(0.0, window)
        self.concurrency = max(0, concurrency)
        self.direct = direct
        self._pending: list[tuple[Publish, asyncio.Future[Verdict]]] = []
        self._scheduled = False
        self._running: set[asyncio.Task[None]] = set()
        self._sending: set[asyncio.Task[None]] = set()

    def _may_start(self) -> bool:
        return not self.concurrency or len(self._running) < self.concurrency

    async def accept(self, publish: Publish) -> Verdict:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Verdict] = loop.create_future()
        self._pending.append((publish, future))
        if self._may_start():
            if len(self._pending) >= self.limit:
                self._flush()
            elif not self._scheduled:
                self._scheduled = True
                if self.window:
                    loop.call_later(self.window, self._flush_if_idle)
                else:  # after the handlers already scheduled in this turn (the rest of the read)
                    loop.call_soon(self._flush_if_idle)
        return await future

    def _flush_if_idle(self) -> None:
        self._scheduled = False
        if self._may_start():
            self._flush()

    def _flush(self) -> None:
        batch, self._pending = self._pending[: self.limit], self._pending[self.limit :]
        if batch:
            task = asyncio.ensure_future(self._accept_batch(batch))
            self._running.add(task)
            task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        """A batch call ended: what gathered meanwhile goes out now."""
        self._running.discard(task)
        if self.concurrency:
            while self._pending and self._may_start():
                self._flush()

    async def _accept_batch(self, batch: list[tuple[Publish, asyncio.Future[Verdict]]]) -> None:
        publishes = [publish for publish, _ in batch]
        claimed: list[int] = []
        try:
            plan = await self._run_blocking(
                publishing.plan_publishes, publishes, claim=self._claim(claimed)
            )
        except Exception as error:
            if not isinstance(error, Unavailable):  # a bug must not leave publishes unanswered
                log.exception("gateway.batch_crashed", extra={"error_type": type(error).__name__})
            if self.direct is not None:
                for app in claimed:
                    self.direct.budget.release(app)
            _answer(batch, range(len(batch)), [Verdict.UNAVAILABLE] * len(batch))
            return
        decided = [index for index, verdict in enumerate(plan.verdicts) if verdict is not None]
        _answer(batch, decided, [plan.verdicts[index] or Verdict.UNAVAILABLE for index in decided])
        for send in plan.direct:
            task = asyncio.ensure_future(self._send_direct(batch, plan, send))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    def _claim(self, claimed: list[int]) -> Callable[[int, int], int] | None:
        """The planning call's `claim`: how many of each app's sends this gateway sends
        itself."""
        if self.direct is None:
            return None
        budget = self.direct.budget

        def claim(app: int, jobs: int) -> int:
            taken = budget.claim(app, jobs)
            if taken:
                claimed.append(app)
            return taken

        return claim

    async def _send_direct(
        self,
        batch: list[tuple[Publish, asyncio.Future[Verdict]]],
        plan: publishing.Plan,
        send: publishing.DirectSend,
    ) -> None:
        assert self.direct is not None
        try:
            verdicts = await self.direct.run(
                direct_sends.send_planned, plan, send, self.direct.journal
            )
        except Exception as error:
            if not isinstance(error, Unavailable):
                log.exception("gateway.direct_crashed", extra={"error_type": type(error).__name__})
            verdicts = [Verdict.UNAVAILABLE] * len(send.indices)
        finally:
            self.direct.budget.release(send.app)
        _answer(batch, send.indices, verdicts)


def _answer(
    batch: list[tuple[Publish, asyncio.Future[Verdict]]],
    indices: Iterable[int],
    verdicts: list[Verdict],
) -> None:
    for index, verdict in zip(indices, verdicts, strict=True):
        future = batch[index][1]
        if not future.done():  # its handler may have timed out meanwhile
            future.set_result(verdict)


class DirectPath:
    """The sends this gateway makes itself (relay/services/direct_sends.py): its budget and
    the threads they run in, apart from the database calls' so that a slow provider holds
    no lookup."""

    def __init__(self, *, share: float, in_flight: int, journal: Journal | None = None) -> None:
        self.budget = direct_sends.Budget(share=share, in_flight=in_flight)
        self.executor = ThreadPoolExecutor(
            max_workers=max(1, in_flight), thread_name_prefix="gateway-send"
        )
        self.journal = journal  # started and stopped by the gateway

    @classmethod
    def configured(cls, journal: Journal) -> DirectPath | None:
        relay = conf.current()
        if relay.direct_send_share <= 0 or relay.direct_sends_in_flight <= 0:
            return None
        return cls(
            share=relay.direct_send_share,
            in_flight=relay.direct_sends_in_flight,
            journal=journal if relay.delivery_journal_seconds > 0 else None,
        )

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, functools.partial(_guarded_call, fn, *args)
        )

    def close(self) -> None:
        """Once the links are closed (every publish answered): no send is left in flight."""
        self.executor.shutdown(wait=True, cancel_futures=True)
        provider_registry.close_all()


class Gateway:
    def __init__(self, *, poll_seconds: float | None = None) -> None:
        relay = conf.current()
        self.lease_seconds = relay.gateway_lease_seconds
        # Every poll renews the leases, so it comes at least every RENEW seconds.
        self.poll_seconds = min(
            poll_seconds or relay.component_poll_seconds, relay.gateway_renew_seconds
        )
        self.name = link_leases.gateway_name(relay.gateway_name)
        self.executor = ThreadPoolExecutor(
            max_workers=relay.gateway_threads, thread_name_prefix="gateway-db"
        )
        # Its own thread: renewals must not queue behind slow publishes.
        self.lease_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-lease")
        # Per held link: the monotonic time by which it must be down unless renewed again.
        self.deadlines: dict[int, float] = {}
        self.stopping: dict[int, asyncio.Task[None]] = {}
        self._held: tuple[int, int, int] = (0, 0, 0)
        # Even when this gateway keeps nothing in it (RELAY_DELIVERY_JOURNAL_SECONDS=0, or no
        # sends of its own), its thread writes what a gateway before it left on this host.
        self.journal = Journal(
            delivery_journal.folder(relay.var_dir),
            interval=relay.delivery_journal_seconds or ORPHANS_ONLY_SECONDS,
        )
        self.publishes = PublishBatcher(
            self.run_blocking,
            limit=conf.current().publish_batch_max,
            window=conf.current().publish_batch_seconds,
            concurrency=conf.current().publish_batch_concurrency,
            direct=DirectPath.configured(self.journal),
        )
        self.links: dict[int, Link] = {}
        # Building a link's stream holds the event loop (what it costs: docs/benchmarks.md,
        # Capacity): the links a lease round takes are built one per turn of the loop, so the
        # lease rounds and the links already up are served in between.
        self.link_builds = asyncio.Lock()
        self.synced = False
        self.stopped = asyncio.Event()
        self.features = features.load(self.run_blocking)
        self.announced = ""  # where web processes reach our features (the leases carry it)

    async def run_blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ORM and broker calls off the event loop; their outages become `Unavailable`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, functools.partial(_guarded_call, fn, *args, **kwargs)
        )

    async def run_lease_call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.lease_executor, functools.partial(_guarded_call, fn, **kwargs)
        )

    async def report(self, component: Component, state: LinkState, error: str) -> None:
        links.note_link_state(component=component, state=state)
        # The link state is advisory; the database may be the very thing that is down.
        with contextlib.suppress(Unavailable):
            await self.run_blocking(
                links.record_link_state,
                component_id=component.pk,
                state=state,
                error=error,
                gateway=self.name,
            )

    def link_states(self) -> dict[int, bool]:
        """Component id -> link up, for /readyz (read from the probe listener's thread); no
        entry until the components were first read, so a starting gateway is not ready."""
        if not self.synced:
            return {0: False}
        return {pk: link.up.is_set() for pk, link in list(self.links.items())}

    async def sync_links(self) -> None:
        """One lease round, then the links follow the leases held (and the components)."""
        started = time.monotonic()
        try:
            result: link_leases.LeaseRound = await self.run_lease_call(
                link_leases.lease_round,
                gateway=self.name,
                ttl=self.lease_seconds,
                channel=self.announced,
            )
        except Unavailable:
            log.warning("gateway.lease_round_failed")
            return  # the watchdog drops the links whose leases may run out meanwhile
        deadline = started + self.lease_seconds - link_leases.DROP_MARGIN_SECONDS
        if time.monotonic() >= deadline:
            log.warning("gateway.lease_round_too_slow")
            return
        self.synced = True
        shed = set(result.shed)
        wanted = {c.pk: c for c in result.held if c.pk not in shed}
        previous, self.deadlines = self.deadlines, {pk: deadline for pk in wanted}
        # A link to close whose lease still lasts a graceful close (a disabled component) is
        # closed gracefully; one whose lease may run out sooner (lost) is cut now.
        closing_by = time.monotonic() + SHED_GRACE_SECONDS + CLOSE_SECONDS
        held = (len(wanted), result.live_gateways, result.share)
        if held != self._held:
            self._held = held
            log.info(
                "gateway.leases",
                extra={"links": held[0], "gateways": held[1], "share": held[2]},
            )
        for pk in list(self.links):
            link = self.links[pk]
            if pk not in wanted or _link_key(wanted[pk]) != link.key:
                del self.links[pk]
                if pk not in wanted and pk not in shed and previous.get(pk, 0.0) < closing_by:
                    link.drop()
                log.info("gateway.link_removed", extra={"component_id": pk})
                self._stop_later(link, release=pk in shed)
        for pk in shed - set(self.stopping):
            self._stop_later(None, release=True, component_id=pk)
        for pk, component in wanted.items():
            if pk in self.stopping:
                continue  # the old link is still closing; the next round starts it
            if pk not in self.links:
                log.info("gateway.link_added", extra={"component_id": pk})
                link = Link(self, component)
                self.links[pk] = link
                link.start()
            else:
                self.links[pk].component = component

    def _stop_later(
        self, link: Link | None, *, release: bool, component_id: int | None = None
    ) -> None:
        """Close a link without holding up the lease round; a lease given up (over our fair
        share) is released only once its link is down."""
        pk = link.component.pk if link is not None else component_id
        assert pk is not None

        async def stop() -> None:
            try:
                if link is not None:
                    await link.stop(grace=SHED_GRACE_SECONDS)
                    links.forget_link(component=link.component)
                if release:
                    with contextlib.suppress(Unavailable):
                        await self.run_lease_call(
                            link_leases.release, gateway=self.name, component_ids=[pk]
                        )
            finally:
                self.stopping.pop(pk, None)

        self.stopping[pk] = asyncio.create_task(stop(), name=f"stop-link-{pk}")

    async def watchdog(self) -> None:
        """Drop every link whose deadline passed: its lease was not renewed in time (the
        database or this process was too slow), and another gateway may take it soon."""
        while not self.stopped.is_set():
            now = time.monotonic()
            for pk in [pk for pk in self.links if self.deadlines.get(pk, 0.0) <= now]:
                link = self.links.pop(pk)
                link.drop()
                self.deadlines.pop(pk, None)
                log.warning("link.lease_lost", extra={"component_id": pk})
                self._stop_later(link, release=False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), timeout=WATCHDOG_SECONDS)

    async def write_tallies(self) -> None:
        """The publish tallies summed since the last batch that wrote them (relay/services/
        tallies.py): written once they are due, so the last publishes of a burst are not held
        until the next one."""
        while not self.stopped.is_set():
            wait = max(tallies.due_in(), WATCHDOG_SECONDS)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), timeout=wait)
            if tallies.pending() and tallies.due_in() <= 0 and not self.stopped.is_set():
                with contextlib.suppress(Unavailable):  # kept for the next round
                    await self.run_blocking(tallies.flush)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stopped.set)
        probes = ProbeServer(
            "gateway",
            conf.current().gateway_probe_listen,
            lambda: health.gateway_readiness(self.link_states()),
        )
        probes.start()
        self.journal.start()
        log.info("gateway.started", extra={"gateway": self.name})
        for feature in self.features:
            self.announced = self.announced or await feature.start()
        plugged = [
            asyncio.create_task(feature.run(self.stopped), name=type(feature).__name__)
            for feature in self.features
        ]
        watchdog = asyncio.create_task(self.watchdog(), name="lease-watchdog")
        tally_writer = asyncio.create_task(self.write_tallies(), name="tally-writer")
        while not self.stopped.is_set():
            await self.sync_links()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), timeout=self.poll_seconds)
        await watchdog
        await self.shutdown(plugged)
        for feature in self.features:
            await feature.stop()
        await tally_writer
        probes.stop()

    async def shutdown(self, plugged: list[asyncio.Task[None]] | None = None) -> None:
        log.info("gateway.stopping", extra={"links": len(self.links)})
        # No more renewals: every link must be closed before its lease could run out.
        now = time.monotonic()
        first_deadline = min((self.deadlines.get(pk, now) for pk in self.links), default=now)
        grace = max(0.0, min(5.0, first_deadline - now - CLOSE_SECONDS))
        links_to_stop = list(self.links.values())
        self.links.clear()
        await asyncio.gather(
            *(link.stop(grace=grace) for link in links_to_stop),
            *self.stopping.values(),
            *(plugged or []),  # the features' last writes need the executor closed below
            return_exceptions=True,
        )
        # The sends in flight end (their publishes answered and tallied), then the last
        # tallies are written before the threads go.
        if self.publishes.direct is not None:
            self.publishes.direct.close()
        await asyncio.get_running_loop().run_in_executor(None, self.journal.stop)
        with contextlib.suppress(Unavailable):
            await self.run_blocking(tallies.flush)
        # Links closed: their leases go at once, the other gateways take them next round.
        try:
            released = await self.run_lease_call(link_leases.leave, gateway=self.name)
        except Unavailable:
            released = None  # they expire within GATEWAY_LEASE_SECONDS
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.lease_executor.shutdown(wait=True, cancel_futures=True)
        log.info("gateway.stopped", extra={"leases_released": released})


# A thread's database connection in steady use is not health-checked before each call: the
# `SELECT 1` that Django's check costs was a round trip per publish batch (a tenth of the
# gateway's time at 100 publishes/s). It is checked after an error (a restarted server:
# the batch that met it answered `wait`, the next one reconnects), past CONN_MAX_AGE, and
# before the first call after this long idle (where a dead connection is likeliest).
HEALTH_CHECK_IDLE_SECONDS = 1.0
_thread_state = threading.local()


def _prepare_connections() -> None:
    now = time.monotonic()
    idle = now - getattr(_thread_state, "last_call", -HEALTH_CHECK_IDLE_SECONDS)
    _thread_state.last_call = now
    if idle >= HEALTH_CHECK_IDLE_SECONDS:
        close_old_connections()
        return
    for conn in connections.all(initialized_only=True):
        if conn.errors_occurred or (conn.close_at is not None and now >= conn.close_at):
            conn.close_if_unusable_or_obsolete()


def _guarded_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _prepare_connections()
    try:
        return fn(*args, **kwargs)
    except (DatabaseError, QueueUnavailable) as error:
        log.warning("gateway.backend_unavailable", extra={"error_type": type(error).__name__})
        raise Unavailable from error
