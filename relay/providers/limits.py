"""A cap on sends in flight per provider in this process (Sygnal's ConcurrencyLimitedPushkin).

A provider that slows down (APNs holding streams, FCM answering in seconds) must not take
every worker thread with it: beyond RELAY["MAX_IN_FLIGHT_PER_PROVIDER"] concurrent sends to
one provider, a send waits up to RELAY["IN_FLIGHT_WAIT_SECONDS"] for a slot, then gives up as
RETRY_LATER so the delivery engine retries it with backoff. The cap is per process: the whole
pool's cap is that times the number of worker processes.
"""

from __future__ import annotations

import logging
import os
import threading

from django.conf import settings

from relay.models import Outcome
from relay.providers.base import PushProvider, SendResult, Wakeup, send_each

log = logging.getLogger(__name__)

IN_FLIGHT_CAP = "IN_FLIGHT_CAP"
# Slots one batch holds at a time (FCM overlaps 16 requests per batch).
BATCH_SLOTS = 16

_lock = threading.Lock()
_slots: dict[str, threading.BoundedSemaphore] = {}
_in_flight: dict[str, int] = {}


def _semaphore(service: str) -> threading.BoundedSemaphore | None:
    cap = int(settings.RELAY["MAX_IN_FLIGHT_PER_PROVIDER"])
    if cap <= 0:
        return None
    with _lock:
        slot = _slots.get(service)
        if slot is None:
            slot = _slots[service] = threading.BoundedSemaphore(cap)
        return slot


def in_flight(service: str) -> int:
    """Sends to `service` in progress in this process (metrics and tests)."""
    with _lock:
        return _in_flight.get(service, 0)


def send_limited(provider: PushProvider, wakeup: Wakeup, *, service: str) -> SendResult:
    """`provider.send(wakeup)` within the per-provider cap."""
    slot = _semaphore(service)
    if slot is not None and not slot.acquire(
        timeout=float(settings.RELAY["IN_FLIGHT_WAIT_SECONDS"])
    ):
        log.warning("delivery.in_flight_cap", extra={"provider": service})
        return SendResult(Outcome.RETRY_LATER, IN_FLIGHT_CAP)
    with _lock:
        _in_flight[service] = _in_flight.get(service, 0) + 1
    try:
        return provider.send(wakeup)
    finally:
        with _lock:
            _in_flight[service] -= 1
        if slot is not None:
            slot.release()


def send_many_limited(
    provider: PushProvider, wakeups: list[Wakeup], *, service: str
) -> list[SendResult]:
    """A batch through `send_each`, one cap slot per wake-up in flight: it waits (as
    `send_limited`) for a first slot, takes what else is free at once (at most BATCH_SLOTS,
    so one batch never starves the others for long), sends those, and repeats; whatever finds
    no slot in time is RETRY_LATER, as a single send would be."""
    if len(wakeups) == 1:
        return [send_limited(provider, wakeups[0], service=service)]
    slot = _semaphore(service)
    results: list[SendResult] = []
    while len(results) < len(wakeups):
        remaining = wakeups[len(results) :]
        taken = len(remaining)
        if slot is not None:
            if not slot.acquire(timeout=float(settings.RELAY["IN_FLIGHT_WAIT_SECONDS"])):
                log.warning("delivery.in_flight_cap", extra={"provider": service})
                results.extend([SendResult(Outcome.RETRY_LATER, IN_FLIGHT_CAP)] * taken)
                break
            taken = 1
            while taken < min(len(remaining), BATCH_SLOTS) and slot.acquire(blocking=False):
                taken += 1
        with _lock:
            _in_flight[service] = _in_flight.get(service, 0) + taken
        try:
            results.extend(send_each(provider, remaining[:taken]))
        finally:
            with _lock:
                _in_flight[service] -= taken
            if slot is not None:
                for _ in range(taken):
                    slot.release()
    return results


def reset() -> None:
    """Forget the slots, so a changed cap applies (tests)."""
    with _lock:
        _slots.clear()


def _reset_after_fork() -> None:
    """A forked worker child starts with free slots (the parent's holders do not exist)."""
    global _lock
    _lock = threading.Lock()
    _slots.clear()
    _in_flight.clear()


os.register_at_fork(after_in_child=_reset_after_fork)
