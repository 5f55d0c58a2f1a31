"""The one small interface every push provider implements.

A provider sends one content-free wake-up and classifies the answer as delivered, dead token,
retry later or failed. Everything else (retries, records, dead registrations) is decided by
`relay.services.delivery` from that classification, so a new provider is one new module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.utils
import functools
import logging
import os
import ssl
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar, Protocol, TypeVar

import aiohttp

log = logging.getLogger(__name__)
T = TypeVar("T")

# What a provider's client is built with when its caller gives no timeout (seconds); the
# registry passes RELAY_PROVIDER_TIMEOUT_SECONDS, whose default this is.
DEFAULT_TIMEOUT_SECONDS = 5.0


class Outcome(StrEnum):
    """How a push ended: the provider interface classifies every answer into one of these.

    A plain enum, so the providers stay Django-free; `relay.models.Delivery.outcome` takes its
    choices from it.
    """

    DELIVERED = "delivered"
    DEAD_TOKEN = "dead_token"
    RETRY_LATER = "retry_later"
    FAILED = "failed"

    @property
    def label(self) -> str:
        return self.value.replace("_", " ")


@dataclass(frozen=True, slots=True)
class Wakeup:
    """What a provider may know of a push: an address and hashes, never a JID or body."""

    push_id: str
    token: str
    account: str
    channel: str = ""
    important: bool = False
    message_count: int | None = None
    pending_subscription_count: int | None = None


@dataclass(frozen=True, slots=True)
class SendResult:
    outcome: Outcome
    error_code: str = ""
    retry_after: float | None = None

    @classmethod
    def delivered(cls) -> SendResult:
        return cls(Outcome.DELIVERED)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return None
    return max(0.0, seconds)


class PushProvider(Protocol):
    """Built once per app and credentials version, then reused for many sends."""

    service: ClassVar[str]

    def send(self, wakeup: Wakeup) -> SendResult:
        """Send one wake-up; never raise for a provider's answer, classify it instead."""
        ...

    def close(self) -> None:
        """Release connections when the app's credentials change or the worker stops."""
        ...

    # Optional: `send_many(wakeups) -> list[SendResult]`, one result per wake-up in order,
    # for providers that send a batch better than `send` in threads (FCM, APNs, Web Push,
    # WNS: on the provider loop). `send_each` falls back to `send` over a shared thread pool.


def send_one(provider: PushProvider, wakeup: Wakeup) -> SendResult:
    """`provider.send`, where a crash counts as passing trouble (a provider must classify)."""
    try:
        return provider.send(wakeup)
    except Exception as error:
        log.exception("delivery.provider_crashed", extra={"error_type": type(error).__name__})
        return SendResult(Outcome.RETRY_LATER, error_code="INTERNAL")


# A provider without `send_many` still has its batch's sends overlapped (providers are shared
# between worker threads already, so `send` is thread-safe): one pool per process.
FALLBACK_THREADS = 32
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _fallback_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=FALLBACK_THREADS, thread_name_prefix="provider-send"
            )
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _pool_lock
    _pool_lock = threading.Lock()
    _pool = None


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def send_each(provider: PushProvider, wakeups: Sequence[Wakeup]) -> list[SendResult]:
    """Send a batch through the provider's `send_many` if it has one, else `send` for each
    wake-up over a shared thread pool (a batch must not wait for one round trip after the
    other)."""
    if len(wakeups) < 2:
        return [send_one(provider, wakeup) for wakeup in wakeups]
    send_many = getattr(provider, "send_many", None)
    if send_many is None:
        return list(_fallback_pool().map(functools.partial(send_one, provider), wakeups))
    try:
        results = list(send_many(list(wakeups)))
    except Exception as error:
        log.exception("delivery.provider_crashed", extra={"error_type": type(error).__name__})
        results = []
    if len(results) != len(wakeups):
        return [SendResult(Outcome.RETRY_LATER, error_code="INTERNAL")] * len(wakeups)
    return results


# --- the per-process event loop of the providers that send asynchronously ---------------------


BLOCKING_THREADS = 4
# A provider's requests in flight at once on the loop, over all its batches; one beyond waits.
# A provider that never answers holds at most these until they time out (what its breaker
# learns from).
BATCH_REQUESTS_IN_FLIGHT = 64


class LoopThread:
    """An asyncio loop running forever in a daemon thread of this process, shared by the
    providers' batches (APNs' aioapns; FCM's, Web Push's and WNS's aiohttp): their callers
    (worker and gateway threads) are synchronous, and one loop serves every send of the
    process, where a thread per send would be switched to and from for each."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        # What the loop's sends must not wait for runs here: a token fetch, a name lookup.
        self.loop.set_default_executor(
            ThreadPoolExecutor(max_workers=BLOCKING_THREADS, thread_name_prefix="provider-loop")
        )
        self._thread = threading.Thread(target=self._run, name="provider-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def usable(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def send_batch(
        self, batch: Coroutine[Any, Any, list[SendResult]], count: int, seconds: float
    ) -> list[SendResult]:
        """A batch's results from the loop. Its requests enforce their timeouts themselves:
        only a wedged loop reaches `seconds`, and the batch is then cancelled and answered
        retry later (the sends are kept and tried again)."""
        future = self.submit(batch)
        try:
            return future.result(seconds)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return [SendResult(Outcome.RETRY_LATER, "TIMEOUT")] * count
        except concurrent.futures.CancelledError:  # the loop stopped under the batch
            return [SendResult(Outcome.RETRY_LATER, "CLOSED")] * count


_loop_lock = threading.Lock()
_loop: LoopThread | None = None


def shared_loop() -> LoopThread:
    """This process's loop (a new one after a fork)."""
    global _loop
    with _loop_lock:
        if _loop is None or not _loop.usable:
            _loop = LoopThread()
        return _loop


def _forget_loop_after_fork() -> None:
    """The parent's loop thread does not exist in a forked child; its lock may be held."""
    global _loop, _loop_lock
    _loop = None
    _loop_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_loop_after_fork)


class ProviderClosed(Exception):
    """The provider was closed (its app's credentials changed) under a send: the retry uses
    the new ones."""


class LoopSession:
    """A provider's aiohttp session on this process's provider loop: built there on first
    use (the session binds to the loop) and again after a fork; at most
    BATCH_REQUESTS_IN_FLIGHT connections; closed with the provider. Thread-safe."""

    def __init__(
        self,
        *,
        timeout: aiohttp.ClientTimeout,
        build_timeout: float,
        tls: Callable[[], ssl.SSLContext | None] = lambda: None,
    ) -> None:
        self._timeout = timeout
        self._build_timeout = build_timeout
        self._tls = tls
        self._lock = threading.Lock()
        self._closed = False
        self._session: aiohttp.ClientSession | None = None
        self._runner: LoopThread | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def here(self) -> tuple[LoopThread, aiohttp.ClientSession]:
        """This process's loop and the session on it; ProviderClosed once closed."""
        with self._lock:
            if self._closed:
                raise ProviderClosed
            runner = shared_loop()
            if self._session is None or self._runner is not runner:
                self._session = runner.submit(self._new()).result(self._build_timeout)
                self._runner = runner
            return runner, self._session

    async def _new(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=BATCH_REQUESTS_IN_FLIGHT,
            ssl=self._tls() or True,
            # The system's resolver, in the loop's executor: aiodns, where installed, would
            # be aiohttp's choice and starts a thread of its own.
            resolver=aiohttp.ThreadedResolver(),
        )
        return aiohttp.ClientSession(connector=connector, timeout=self._timeout)

    def close(self) -> bool:
        """Close the session (idempotent); False if it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            session, runner = self._session, self._runner
            self._session = self._runner = None
        if session is not None and runner is not None and runner.usable:
            try:
                runner.submit(session.close()).result(5.0)
            except Exception as error:  # closing must not fail a credentials change
                log.warning("provider.close_failed", extra={"error_type": type(error).__name__})
        return True
