"""The gateway process: every enabled component link in one asyncio loop.

slixmpp neither reconnects after a stream error or a server restart nor reports a wrong
secret beyond one event, so each link runs under a supervisor loop here. A link that was up
(the handshake passed) comes back after the shortest delay, however often it dropped: a drop
caused by bad input is not a reason to wait. The delay grows only while connecting fails
(refused, wrong secret). The set of links follows the database: added, changed, disabled and
deleted components are picked up by polling, without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import Error as DatabaseError
from django.db import close_old_connections

from relay import conf
from relay.models import Component, LinkState
from relay.services import links, publishing
from relay.services.publishing import Publish, Verdict
from relay.services.queue import QueueUnavailable
from xmppgateway.component import PushComponent
from xmppgateway.handlers import RunBlocking, Unavailable
from xmppgateway.stream import StreamLimits
from xmppgateway.unifiedpush import UnifiedPushRelay

log = logging.getLogger(__name__)


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
        await self.gateway.report(self.component.pk, LinkState.DOWN, "")

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
            await self.gateway.report(self.component.pk, LinkState.DOWN, reason)
            await asyncio.sleep(wait)
            delay = min(maximum, delay * 2)

    async def _connect_once(self) -> tuple[str, bool]:
        """Connect, serve until the link ends; say why it ended and whether it was up."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str] = loop.create_future()
        stream_error: list[str] = []
        was_up = False
        relay = self.gateway.unifiedpush
        component_id = self.component.pk
        xmpp = PushComponent(
            self.component,
            run_blocking=self.gateway.run_blocking,
            max_field_length=conf.current().max_field_length,
            limits=StreamLimits(
                max_stanza_bytes=conf.current().max_stanza_bytes,
                max_depth=conf.current().max_stanza_depth,
            ),
            max_in_flight=conf.current().link_max_in_flight,
            accept_publish=self.gateway.publishes.accept,
            iq_set_handlers=relay.iq_set_handlers(),
            on_iq_answer=lambda xml: relay.on_iq_answer(component_id, xml),
            on_presence=lambda xml: relay.on_presence(component_id, xml),
        )
        self.xmpp = xmpp

        def finish(reason: str) -> None:
            if not ended.done():
                ended.set_result(reason)

        def on_session_start(_: Any) -> None:
            nonlocal was_up
            was_up = True
            self.up.set()
            relay.link_up(component_id, self.component.jid, xmpp)
            log.info("link.up", extra={"component_id": self.component.pk})
            self._report = asyncio.ensure_future(
                self.gateway.report(self.component.pk, LinkState.UP, "")
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
        await self.gateway.report(self.component.pk, LinkState.CONNECTING, "")
        xmpp.connect()
        try:
            reason = await ended
        finally:
            self.up.clear()
            relay.link_down(component_id)
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
    """Gathers the publishes of every link that arrive within `window` seconds (at most
    `limit`) into ONE `accept_publishes` call in the executor: one database query, one
    throttling round trip and one broker message per batch instead of per publish.

    Each publish still gets its own verdict, and only once the batch call returned, that is
    once its job is in the broker; a batch that fails as a whole answers `wait` to all.
    """

    def __init__(self, run_blocking: RunBlocking, *, window: float, limit: int) -> None:
        self._run_blocking = run_blocking
        self.window = window
        self.limit = max(1, limit)
        self._pending: list[tuple[Publish, asyncio.Future[Verdict]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task[None]] = set()

    async def accept(self, publish: Publish) -> Verdict:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Verdict] = loop.create_future()
        self._pending.append((publish, future))
        if len(self._pending) >= self.limit:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.ensure_future(self._accept_batch(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _accept_batch(self, batch: list[tuple[Publish, asyncio.Future[Verdict]]]) -> None:
        try:
            verdicts = await self._run_blocking(
                publishing.accept_publishes, [publish for publish, _ in batch]
            )
        except Unavailable:
            verdicts = [Verdict.UNAVAILABLE] * len(batch)
        except Exception as error:  # a bug must not leave publishes unanswered
            log.exception("gateway.batch_crashed", extra={"error_type": type(error).__name__})
            verdicts = [Verdict.UNAVAILABLE] * len(batch)
        for (_, future), verdict in zip(batch, verdicts, strict=True):
            if not future.done():  # its handler may have timed out meanwhile
                future.set_result(verdict)


class Gateway:
    def __init__(self, *, poll_seconds: float | None = None) -> None:
        self.poll_seconds = poll_seconds or conf.current().component_poll_seconds
        self.executor = ThreadPoolExecutor(
            max_workers=conf.current().gateway_threads, thread_name_prefix="gateway-db"
        )
        self.publishes = PublishBatcher(
            self.run_blocking,
            window=conf.current().publish_batch_seconds,
            limit=conf.current().publish_batch_max,
        )
        self.links: dict[int, Link] = {}
        self.stopped = asyncio.Event()
        self.unifiedpush = UnifiedPushRelay(self.run_blocking)

    async def run_blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ORM and broker calls off the event loop; their outages become `Unavailable`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, functools.partial(_guarded_call, fn, *args, **kwargs)
        )

    async def report(self, component_id: int, state: LinkState, error: str) -> None:
        # The link state is advisory; the database may be the very thing that is down.
        with contextlib.suppress(Unavailable):
            await self.run_blocking(
                links.record_link_state, component_id=component_id, state=state, error=error
            )

    async def sync_links(self) -> None:
        try:
            components = await self.run_blocking(links.enabled_components)
        except Unavailable:
            log.warning("gateway.components_unavailable")
            return
        wanted = {component.pk: component for component in components}
        for pk in list(self.links):
            link = self.links[pk]
            if pk not in wanted or _link_key(wanted[pk]) != link.key:
                del self.links[pk]
                log.info("gateway.link_removed", extra={"component_id": pk})
                await link.stop()
        for pk, component in wanted.items():
            if pk not in self.links:
                log.info("gateway.link_added", extra={"component_id": pk})
                link = Link(self, component)
                self.links[pk] = link
                link.start()
            else:
                self.links[pk].component = component

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stopped.set)
        log.info("gateway.started")
        unifiedpush = asyncio.create_task(self.unifiedpush.run(self.stopped), name="unifiedpush")
        while not self.stopped.is_set():
            await self.sync_links()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), timeout=self.poll_seconds)
        await unifiedpush  # its last writes need the executor that shutdown() closes
        await self.shutdown()

    async def shutdown(self) -> None:
        log.info("gateway.stopping", extra={"links": len(self.links)})
        links_to_stop = list(self.links.values())
        self.links.clear()
        await asyncio.gather(*(link.stop() for link in links_to_stop), return_exceptions=True)
        self.executor.shutdown(wait=True, cancel_futures=True)
        log.info("gateway.stopped")


def _guarded_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    close_old_connections()
    try:
        return fn(*args, **kwargs)
    except (DatabaseError, QueueUnavailable) as error:
        log.warning("gateway.backend_unavailable", extra={"error_type": type(error).__name__})
        raise Unavailable from error
