"""Sending one queued push and deciding what its outcome means.

Providers only classify (delivered / dead token / retry later / failed); this module decides
what follows:

- delivered: recorded, the registration's `last_push` moves.
- dead token: the registration dies (the next publish is answered item-not-found).
- retry later: re-queued as a copy with the SAME push id, attempt + 1 and a delay: exponential
  backoff with full jitter, never sooner than the provider's Retry-After (capped at
  SEND_RETRY_MAX_SECONDS), and at least SEND_QUOTA_MIN_SECONDS after a quota error without
  one. Bounded by SEND_MAX_ATTEMPTS and by age: a wake-up that would go out later than
  SEND_MAX_AGE_SECONDS after the publish is useless, so it is given up at once.
- failed, retries exhausted, too old, or the retry could not be queued: a dead letter
  (relay/services/dead_letters.py) that the admin can replay, plus the Delivery record.

Every final outcome is one Delivery row per push id. A push redelivered after a worker died
(acks_late) or replayed from a dead letter keeps its push id, so its row is updated, not
doubled, and the providers see the same id (APNs `apns-id`; FCM and WNS when the app's payload
options name a key for it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import uuid
from collections.abc import Iterator
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from relay.models import App, DeadLetter, Delivery, Outcome, Priority, Registration
from relay.providers import registry
from relay.providers.base import SendResult, Wakeup
from relay.providers.limits import send_many_limited
from relay.services import lifecycle, queue, throttling

log = logging.getLogger(__name__)

LAST_PUSH_RESOLUTION_SECONDS = 60
# Codes that mean "you are sending too much": back off for longer than for a hiccup.
QUOTA_CODES = frozenset(
    {"QUOTA_EXCEEDED", "HTTP_429", "TooManyRequests", "TooManyProviderTokenUpdates", "THROTTLED"}
)


def retry_delay(attempt: int, retry_after: float | None, *, quota: bool = False) -> float:
    """Seconds before attempt `attempt + 1`: full jitter over an exponential ceiling, above
    the provider's Retry-After (or the quota minimum), never above SEND_RETRY_MAX_SECONDS.

    The jitter is added on top of a Retry-After so that a burst refused together does not
    come back together.
    """
    base = float(settings.RELAY["SEND_RETRY_BASE_SECONDS"])
    cap = float(settings.RELAY["SEND_RETRY_MAX_SECONDS"])
    jitter = random.uniform(0, min(cap, base * (2 ** (max(attempt, 1) - 1))))
    floor = 0.0
    if retry_after is not None:
        floor = min(max(retry_after, 0.0), cap)
    elif quota:
        floor = min(float(settings.RELAY["SEND_QUOTA_MIN_SECONDS"]), cap)
    if not floor:
        return jitter
    return min(cap, floor + jitter)


def _age_seconds(job: queue.SendJob, now: datetime) -> float:
    start = datetime.fromisoformat(job.replayed or job.received)
    return (now - start).total_seconds()


def _wakeup(registration: Registration, job: queue.SendJob) -> Wakeup:
    return Wakeup(
        push_id=job.push_id,
        token=registration.token,
        account=registration.device_hash,
        channel=registration.room_hash,
        important=job.important,
        message_count=job.message_count,
        pending_subscription_count=job.pending_subscription_count,
    )


def _send_group(group: list[tuple[Registration, queue.SendJob]]) -> list[SendResult]:
    """Send wake-ups that share an app and a service through one provider."""
    registration = group[0][0]
    try:
        provider = registry.provider_for(registration.app, registration.service)
    except registry.NotConfigured as error:
        return [SendResult(Outcome.FAILED, error_code=error.code)] * len(group)
    wakeups = [_wakeup(registration, job) for registration, job in group]
    try:
        return send_many_limited(provider, wakeups, service=registration.service)
    except Exception as error:  # a provider must classify; a crash is treated as passing trouble
        log.exception("delivery.provider_crashed", extra={"error_type": type(error).__name__})
        return [SendResult(Outcome.RETRY_LATER, error_code="INTERNAL")] * len(group)


def _claim_folded(registration: Registration, job: queue.SendJob) -> queue.SendJob:
    """A coalesced send carries what was folded into it: the latest counts, and important if
    any folded publish was. Claimed once; a redelivered copy sends its own values."""
    taken = throttling.take(registration=registration, push_id=job.push_id)
    if taken is None:
        return job
    return dataclasses.replace(
        job,
        important=taken.important or job.important,
        message_count=(
            taken.message_count if taken.message_count is not None else job.message_count
        ),
        pending_subscription_count=(
            taken.pending_subscription_count
            if taken.pending_subscription_count is not None
            else job.pending_subscription_count
        ),
        folded=taken.folded,
    )


def _retry(job: queue.SendJob, result: SendResult, now: datetime) -> str:
    """Queue the next attempt; "" if queued, else why the push is given up."""
    code = result.error_code or "RETRY_LATER"
    if job.attempt >= int(settings.RELAY["SEND_MAX_ATTEMPTS"]):
        return f"retries exhausted: {code}"
    delay = retry_delay(job.attempt, result.retry_after, quota=code in QUOTA_CODES)
    if _age_seconds(job, now) + delay >= float(settings.RELAY["SEND_MAX_AGE_SECONDS"]):
        return f"too old: {code}"
    try:
        queue.enqueue_send(
            dataclasses.replace(job, attempt=job.attempt + 1, coalesced=False), countdown=delay
        )
    except queue.QueueUnavailable:
        return f"not re-queued: {code}"
    log.info(
        "delivery.retry_scheduled",
        extra={
            "push_id": job.push_id,
            "attempt": job.attempt,
            "code": code,
            "delay": round(delay, 3),
        },
    )
    return ""


def deliver(job: queue.SendJob) -> Outcome:
    """Send one queued push and act on its outcome (a batch of one)."""
    return deliver_many([job])[0]


def _load_registrations(ids: set[int]) -> dict[int, Registration]:
    """The batch's registrations with their apps: two queries, and each app's credentials
    decrypted once per batch instead of once per row."""
    registrations = Registration.objects.in_bulk(ids)
    apps = App.objects.in_bulk({registration.app_id for registration in registrations.values()})
    for registration in registrations.values():
        registration.app = apps[registration.app_id]
    return registrations


def deliver_many(jobs: list[queue.SendJob]) -> list[Outcome]:
    """Send a batch of queued pushes; one outcome per job, in order.

    Each job ends exactly as `deliver` alone would end it (retried with its own backoff and
    push id, dead-lettered, recorded), but the batch shares its queries: the registrations in
    two, the sends grouped per app and service (the provider may overlap them), the dead
    tokens, `last_push` and the Delivery rows in one statement each.
    """
    outcomes: list[Outcome] = [Outcome.FAILED] * len(jobs)
    registrations = _load_registrations({job.registration_id for job in jobs})
    items: list[tuple[int, Registration, queue.SendJob]] = []
    results: dict[int, SendResult] = {}
    groups: dict[tuple[int, str], list[tuple[int, Registration, queue.SendJob]]] = {}
    for index, job in enumerate(jobs):
        registration = registrations.get(job.registration_id)
        if registration is None:
            log.info("delivery.registration_gone", extra={"push_id": job.push_id})
            continue
        if job.coalesced and job.attempt == 1:
            job = _claim_folded(registration, job)
        items.append((index, registration, job))
        if registration.dead_since is not None:
            results[index] = SendResult(Outcome.DEAD_TOKEN, error_code="ALREADY_DEAD")
        else:
            key = (registration.app_id, registration.service)
            groups.setdefault(key, []).append((index, registration, job))
    for group in groups.values():
        sent = _send_group([(registration, job) for _, registration, job in group])
        for (index, _, _), result in zip(group, sent, strict=True):
            results[index] = result

    now = timezone.now()
    dead: list[int] = []
    delivered: list[int] = []
    rows: dict[str, Delivery] = {}
    for index, registration, job in items:
        result = results[index]
        given_up = ""
        if result.outcome == Outcome.RETRY_LATER:
            given_up = _retry(job, result, now)
            if not given_up:
                outcomes[index] = Outcome.RETRY_LATER
                continue
            result = SendResult(Outcome.FAILED, error_code=result.error_code or "RETRY_LATER")
        elif result.outcome == Outcome.FAILED:
            given_up = f"failed: {result.error_code or 'UNKNOWN'}"
        if result.outcome == Outcome.DEAD_TOKEN:
            dead.append(registration.pk)
        if result.outcome == Outcome.DELIVERED:
            delivered.append(registration.pk)
        if given_up:
            _dead_letter(registration, job, given_up)
        rows[job.push_id] = _row(registration, job, result, now)
        outcomes[index] = result.outcome
        log.info(
            "delivery.done",
            extra={
                "push_id": job.push_id,
                "provider": registration.service,
                "outcome": result.outcome.value,
                "code": result.error_code,
                "attempt": job.attempt,
                "coalesced": job.folded,
                "dead_letter": bool(given_up),
            },
        )
    with _bookkeeping():
        if dead:
            Registration.objects.filter(pk__in=dead, dead_since__isnull=True).update(dead_since=now)
            lifecycle.died(dead, at=now)
        if delivered:
            stale = now - timezone.timedelta(seconds=LAST_PUSH_RESOLUTION_SECONDS)
            Registration.objects.filter(
                Q(last_push__isnull=True) | Q(last_push__lt=stale), pk__in=delivered
            ).update(last_push=now)
        _record(list(rows.values()))
    return outcomes


@contextlib.contextmanager
def _bookkeeping() -> Iterator[None]:
    """One commit for what a batch learnt, and on PostgreSQL without waiting for the WAL
    flush: a commit per statement was what bounded single sends. These rows are bookkeeping;
    a crash may lose the last few, and a dead token lost so is learnt again at the next send.
    """
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
        yield


def _dead_letter(registration: Registration, job: queue.SendJob, reason: str) -> None:
    """Keep the job (it holds no token, JID or body) for a replay with the same push id."""
    DeadLetter.objects.update_or_create(
        push_id=uuid.UUID(job.push_id),
        defaults={
            "tenant_id": registration.app.tenant_id,
            "app_id": registration.app_id,
            "registration_id": registration.pk,
            "provider": registration.service,
            "reason": reason[:64],
            "attempts": job.attempt,
            "job": job.to_message(),
            "replayed": None,
        },
    )
    log.warning(
        "delivery.dead_letter",
        extra={"push_id": job.push_id, "provider": registration.service, "reason": reason},
    )


def _row(
    registration: Registration, job: queue.SendJob, result: SendResult, now: datetime
) -> Delivery:
    return Delivery(
        push_id=uuid.UUID(job.push_id),
        tenant_id=registration.app.tenant_id,
        app_id=registration.app_id,
        registration_id=registration.pk,
        provider=registration.service,
        publishing_domain=job.publishing_domain,
        priority=Priority.HIGH if job.important else Priority.NORMAL,
        received=datetime.fromisoformat(job.received),
        queued=datetime.fromisoformat(job.queued) if job.queued else now,
        sent=now if result.outcome == Outcome.DELIVERED else None,
        attempts=job.attempt,
        outcome=result.outcome,
        error_code=result.error_code[:64],
        coalesced=job.folded,
    )


def _record(rows: list[Delivery]) -> None:
    """One row per push id: a redelivered or replayed push updates its row, never adds one."""
    if not rows:
        return
    Delivery.objects.bulk_create(
        rows,
        # The first record's priority and coalesced count stay: a redelivered copy of a
        # coalesced send no longer knows what was folded into it.
        update_conflicts=True,
        unique_fields=["push_id"],
        update_fields=["sent", "attempts", "outcome", "error_code"],
    )
