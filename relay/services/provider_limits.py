"""Bulkheads between apps and a circuit breaker per app's provider, in one worker process.

One tenant's broken provider must not delay another's. A worker thread that sends waits for
the provider's answer (up to RELAY["PROVIDER_TIMEOUT_SECONDS"]), so a provider that accepts
connections and never answers would hold every thread that sends to it, and with them the
pool every tenant shares. Three limits keep the damage to the app whose provider it is, and
none of them makes a send wait for another app:

- threads: at most RELAY["MAX_THREADS_PER_APP"] worker threads send to one app at once (0, the
  default: three quarters of the worker's threads, so that a quarter, at least one, is always
  left to the other apps). The share is work-conserving: a send beyond it waits in its thread
  for one of its app's slots as long as no other app's message waits for a thread of this
  worker (counted from the worker signals, relay/tasks.py: `task_waiting`, `task_started`): a
  lone tenant's burst sends on its share, queues for it in the other threads, and never goes
  to the database. Once another app's message waits, a send beyond the share steps aside at
  once (RETRY_LATER, APP_IN_FLIGHT_CAP: deferred, the provider never saw it, so no attempt is
  counted) and its thread goes to the queue. It comes back shortly if the app was merely busy;
  if its sends are slow (the oldest in flight for SLOW_SECONDS), once that send has timed out
  (spread over one more timeout), for the breaker's verdict, instead of spinning through the
  broker.
- sends: at most RELAY["MAX_IN_FLIGHT_PER_PROVIDER"] wake-ups in flight per app's provider (a
  batch takes up to BATCH_SLOTS at a time, Sygnal's ConcurrencyLimitedPushkin). A batch waits
  up to RELAY["IN_FLIGHT_WAIT_SECONDS"] for a slot: only the app's own, bounded, threads
  hold them, and bouncing at once would delay pushes under plain load.
- breaker: RELAY["BREAKER_STALLS"] stalls in a row (timeouts, network errors: the provider did
  not answer) open the breaker of that app's provider and credentials. For
  RELAY["BREAKER_SECONDS"] its sends are deferred at once (PROVIDER_STALLED, with the time
  left plus up to one more cool-down as Retry-After, so that they come back spread out) without
  touching the provider or holding a thread; then one probe goes through, and an answer (any
  answer: a provider that says no is not stuck) closes it.

All of it is per process (the threads pool, as the Procfile runs workers): each worker
learns of a stuck provider by itself, after at most BREAKER_STALLS sends.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from relay import conf
from relay.providers.base import Outcome, PushProvider, SendResult, Wakeup, send_each

log = logging.getLogger(__name__)

IN_FLIGHT_CAP = "IN_FLIGHT_CAP"
APP_IN_FLIGHT_CAP = "APP_IN_FLIGHT_CAP"
PROVIDER_STALLED = "PROVIDER_STALLED"
# Slots one batch holds at a time (FCM overlaps 16 requests per batch).
BATCH_SLOTS = 16
# Results that mean "the provider did not answer": what a stuck provider produces.
STALL_CODES = frozenset({"TIMEOUT", "NETWORK", "OAUTH_NETWORK", "AUTH_TIMEOUT", "AUTH_NETWORK"})
# An app whose oldest send in flight is this old (seconds) is slow, not merely busy.
SLOW_SECONDS = 0.5
# A message counted as waiting for a thread this long is forgotten (revoked or expired before
# it ran, or started in a pool child that this process does not see).
WAITING_FORGOTTEN_SECONDS = 60.0
# Deferred for lack of a thread or slot of the app: the provider never saw these.
BUSY_CODES = frozenset({IN_FLIGHT_CAP, APP_IN_FLIGHT_CAP})
# Results that say nothing about the provider (the send never reached it).
_NOT_SENT_CODES = BUSY_CODES | {PROVIDER_STALLED, "CLOSED"}


@dataclass(frozen=True, slots=True)
class Target:
    """Whose provider a group of wake-ups goes to: the app, the service and the credentials'
    version (a changed credential gets a fresh breaker)."""

    app: int
    service: str
    version: str = ""


@dataclass
class _Breaker:
    stalls: int = 0
    open_until: float = 0.0  # time.monotonic(); 0: closed
    probing: bool = False


_lock = threading.Lock()
_freed = threading.Condition(_lock)  # a thread slot was given back
_slots: dict[Hashable, threading.BoundedSemaphore] = {}
_in_flight: dict[Hashable, int] = {}
_threads: dict[int, dict[object, float]] = {}  # app -> {slot token: when taken}
_breakers: dict[Target, _Breaker] = {}
_worker_threads = 0
# Messages received by this worker and not started yet: per app (None: not known), and per
# task id (its apps, when received).
_waiting: dict[int | None, int] = {}
_waiting_tasks: dict[str, tuple[frozenset[int | None], float]] = {}


def set_worker_threads(count: int) -> None:
    """The worker's thread count (relay/tasks.py, at worker start): MAX_THREADS_PER_APP's
    default is three quarters of it. Unknown (0) outside a worker: no thread limit."""
    global _worker_threads
    _worker_threads = max(0, int(count))


def max_threads_per_app() -> int:
    """Threads one app may hold at once in this process; 0: no limit."""
    configured = conf.current().max_threads_per_app
    if configured > 0:
        return configured
    if _worker_threads > 1:
        return _worker_threads - max(1, _worker_threads // 4)
    return 0


def in_flight(key: Hashable) -> int:
    """Wake-ups in flight to `key` (a Target) in this process (metrics and tests)."""
    with _lock:
        return _in_flight.get(key, 0)


def breaker_open(target: Target) -> bool:
    """Whether `target`'s sends are being deferred right now (tests, health)."""
    with _lock:
        breaker = _breakers.get(target)
        return breaker is not None and breaker.open_until > time.monotonic()


def app_breaker_open(app: int) -> bool:
    """Whether any of `app`'s providers has its breaker open in this process (the gateway
    then leaves its sends to the workers, relay/services/direct_sends.py)."""
    now = time.monotonic()
    with _lock:
        return any(
            target.app == app and breaker.open_until > now for target, breaker in _breakers.items()
        )


def send_group(provider: PushProvider, wakeups: list[Wakeup], target: Target) -> list[SendResult]:
    """Send one app's wake-ups through its provider within the app's limits; one result per
    wake-up, in order. Never waits for another app's sends."""
    if not wakeups:
        return []
    admitted, probe, retry_after = _admit(target)
    if not admitted:
        return [SendResult(Outcome.RETRY_LATER, PROVIDER_STALLED, retry_after)] * len(wakeups)
    token, wait, waited = _take_thread(target.app)
    if token is None:
        if probe:
            with _lock:
                _breakers[target].probing = False
        log.info("delivery.app_busy", extra={"app": target.app, "provider": target.service})
        return [SendResult(Outcome.RETRY_LATER, APP_IN_FLIGHT_CAP, wait)] * len(wakeups)
    try:
        if waited and not probe:
            # Its app's breaker may have opened while this send waited for a thread.
            admitted, probe, retry_after = _admit(target)
            if not admitted:
                return [SendResult(Outcome.RETRY_LATER, PROVIDER_STALLED, retry_after)] * len(
                    wakeups
                )
        if probe:
            # One wake-up finds out whether the provider answers again; the rest wait for it.
            results = _send_slotted(provider, wakeups[:1], target, probe=True)
            results += [SendResult(Outcome.RETRY_LATER, PROVIDER_STALLED)] * (len(wakeups) - 1)
            return results
        return _send_slotted(provider, wakeups, target)
    finally:
        with _freed:
            del _threads[target.app][token]
            _freed.notify_all()


def _take_thread(app: int) -> tuple[object | None, float | None, bool]:
    """A thread slot of `app` (a token to give back), or None and a Retry-After; and whether
    it waited for the slot.

    Beyond its share, a send waits for one of its app's slots while no other app's message
    waits for a thread of this worker (at most one provider timeout: every send in flight
    ends by then): the worker is the app's alone, and a slot frees as soon as a send ends.
    Once another app's message waits, the send steps aside at once. A slow app's deferred
    pushes (its oldest send in flight for SLOW_SECONDS) come back once that send has timed
    out, spread over one more timeout: they wait for the breaker's verdict instead of
    spinning through the broker.
    """
    cap = max_threads_per_app()
    patience = conf.current().provider_timeout_seconds
    started = time.monotonic()
    waited = False
    with _freed:
        while True:
            held = _threads.setdefault(app, {})
            now = time.monotonic()
            if not cap or len(held) < cap:
                token = object()
                held[token] = now
                return token, None, waited
            oldest = now - min(held.values())
            if _others_waiting(app) or now - started >= patience:
                break
            waited = True
            _freed.wait(started + patience - now)
    if oldest < SLOW_SECONDS:
        return None, None, waited
    timeout = conf.current().provider_timeout_seconds
    return None, max(SLOW_SECONDS, timeout - oldest) + random.uniform(0, timeout), waited


def _others_waiting(app: int) -> bool:
    """Whether a message of another app (or of an unknown one) waits for a thread (the
    caller holds _lock)."""
    return any(count > 0 and other != app for other, count in _waiting.items())


def task_waiting(task_id: str, apps: set[int | None]) -> None:
    """A send message received by this worker waits for a thread (the `task_received`
    signal): sends beyond their app's share step aside for it if it is another app's."""
    now = time.monotonic()
    with _freed:
        if len(_waiting_tasks) > 1000:
            for stale, (stale_apps, since) in list(_waiting_tasks.items()):
                if now - since > WAITING_FORGOTTEN_SECONDS:
                    del _waiting_tasks[stale]
                    _count_waiting(stale_apps, -1)
        previous = _waiting_tasks.pop(task_id, None)
        if previous is not None:
            _count_waiting(previous[0], -1)
        _waiting_tasks[task_id] = (frozenset(apps), now)
        _count_waiting(apps, 1)
        _freed.notify_all()


def task_started(task_id: str) -> None:
    """The message got its thread (`task_prerun`), or will never run (`task_revoked`)."""
    with _lock:
        entry = _waiting_tasks.pop(task_id, None)
        if entry is not None:
            _count_waiting(entry[0], -1)


def _count_waiting(apps: Iterable[int | None], change: int) -> None:
    for app in apps:
        count = _waiting.get(app, 0) + change
        if count > 0:
            _waiting[app] = count
        else:
            _waiting.pop(app, None)


def waiting() -> dict[int | None, int]:
    """Messages waiting for a thread of this worker, per app (tests)."""
    with _lock:
        return dict(_waiting)


def _admit(target: Target) -> tuple[bool, bool, float | None]:
    """(send?, as the probe?, Retry-After if not)."""
    now = time.monotonic()
    with _lock:
        breaker = _breakers.setdefault(target, _Breaker())
        if not breaker.open_until:
            return True, False, None
        if breaker.open_until > now:
            # Spread over the next cool-down: a stuck app's deferred pushes come back as a
            # steady trickle, not all at once when the breaker half-opens.
            cool_down = conf.current().breaker_seconds
            return False, False, breaker.open_until - now + random.uniform(0, cool_down)
        if breaker.probing:
            return False, False, None
        breaker.probing = True
        return True, True, None


def _learn(target: Target, results: list[SendResult], probe: bool) -> None:
    """Count stalls in a row; open after BREAKER_STALLS, close on any answer."""
    answered = any(
        r.error_code not in STALL_CODES and r.error_code not in _NOT_SENT_CODES for r in results
    )
    stalls = sum(1 for r in results if r.error_code in STALL_CODES)
    cool_down = conf.current().breaker_seconds
    threshold = conf.current().breaker_stalls
    with _lock:
        breaker = _breakers.setdefault(target, _Breaker())
        was_open = bool(breaker.open_until)
        if probe:
            breaker.probing = False
        if answered:
            breaker.stalls = 0
            breaker.open_until = 0.0
        elif stalls:
            breaker.stalls += stalls
            if threshold > 0 and (probe or breaker.stalls >= threshold):
                breaker.open_until = time.monotonic() + cool_down
        else:
            return
        now_open = bool(breaker.open_until)
        count = breaker.stalls
    if now_open and (probe or not was_open):
        log.warning(
            "delivery.breaker_open",
            extra={"app": target.app, "provider": target.service, "stalls": count},
        )
    elif was_open and not now_open:
        log.warning(
            "delivery.breaker_closed", extra={"app": target.app, "provider": target.service}
        )


def _semaphore(key: Hashable) -> threading.BoundedSemaphore | None:
    cap = conf.current().max_in_flight_per_provider
    if cap <= 0:
        return None
    with _lock:
        slot = _slots.get(key)
        if slot is None:
            slot = _slots[key] = threading.BoundedSemaphore(cap)
        return slot


def _send_slotted(
    provider: PushProvider, wakeups: list[Wakeup], target: Target, *, probe: bool = False
) -> list[SendResult]:
    """A batch through `send_each`, one slot of `target`'s cap per wake-up in flight: it waits
    for a first slot, takes what else is free at once (at most BATCH_SLOTS, so one batch never
    starves the others for long), sends those, and repeats; whatever finds no slot in time is
    RETRY_LATER (IN_FLIGHT_CAP). The breaker learns each part's results before its slots are
    given back, and a part that got its slots checks the breaker first: a send that waited for
    the slot of one that just timed out does not follow it to a stuck provider."""
    slot = _semaphore(target)
    results: list[SendResult] = []
    while len(results) < len(wakeups):
        remaining = wakeups[len(results) :]
        taken = len(remaining)
        if slot is not None:
            if not slot.acquire(timeout=conf.current().in_flight_wait_seconds):
                log.warning("delivery.in_flight_cap", extra={"target": str(target)})
                results.extend([SendResult(Outcome.RETRY_LATER, IN_FLIGHT_CAP)] * taken)
                break
            taken = 1
            while taken < min(len(remaining), BATCH_SLOTS) and slot.acquire(blocking=False):
                taken += 1
        retry_after = None if probe else _deferred_for(target)
        if retry_after is not None:
            _release(slot, taken)
            stalled = SendResult(Outcome.RETRY_LATER, PROVIDER_STALLED, retry_after)
            results.extend([stalled] * len(remaining))
            break
        with _lock:
            _in_flight[target] = _in_flight.get(target, 0) + taken
        part: list[SendResult] = []
        try:
            part = send_each(provider, remaining[:taken])
        finally:
            with _lock:
                _in_flight[target] -= taken
            _learn(target, part, probe)
            _release(slot, taken)
        results.extend(part)
    if probe and results[0].error_code == IN_FLIGHT_CAP:
        _learn(target, results, probe)  # the probe found no slot: the next send may probe
    return results


def _deferred_for(target: Target) -> float | None:
    """The Retry-After of a send to `target` while its breaker is open; None if closed."""
    now = time.monotonic()
    with _lock:
        breaker = _breakers.get(target)
        if breaker is None or breaker.open_until <= now:
            return None
        left = breaker.open_until - now
    return left + random.uniform(0, conf.current().breaker_seconds)


def _release(slot: threading.BoundedSemaphore | None, taken: int) -> None:
    if slot is not None:
        for _ in range(taken):
            slot.release()


def reset() -> None:
    """Forget slots, breakers and waiting messages, so changed settings apply (tests)."""
    with _lock:
        _slots.clear()
        _breakers.clear()
        _waiting.clear()
        _waiting_tasks.clear()


def _reset_after_fork() -> None:
    """A forked worker child starts with free slots (the parent's holders do not exist)."""
    global _lock, _freed
    _lock = threading.Lock()
    _freed = threading.Condition(_lock)
    _slots.clear()
    _in_flight.clear()
    _threads.clear()
    _breakers.clear()
    _waiting.clear()
    _waiting_tasks.clear()


os.register_at_fork(after_in_child=_reset_after_fork)
