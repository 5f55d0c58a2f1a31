"""Sending one queued push and deciding what its outcome means.

Providers only classify (delivered / dead token / retry later / failed); this module decides
what follows: the registration dies, the push is retried with backoff, or it is recorded.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import uuid
from datetime import datetime

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from relay.models import Delivery, Outcome, Priority, Registration
from relay.providers import registry
from relay.providers.base import SendResult, Wakeup
from relay.services import queue

log = logging.getLogger(__name__)

LAST_PUSH_RESOLUTION_SECONDS = 60


def retry_delay(attempt: int, retry_after: float | None) -> float:
    """Exponential backoff with full jitter, never sooner than the provider asked."""
    base = settings.RELAY["SEND_RETRY_BASE_SECONDS"]
    cap = settings.RELAY["SEND_RETRY_MAX_SECONDS"]
    delay = random.uniform(0, min(cap, base * (2 ** (attempt - 1))))
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap))
    return delay


def _age_seconds(job: queue.SendJob, now: datetime) -> float:
    return (now - datetime.fromisoformat(job.received)).total_seconds()


def _send(registration: Registration, job: queue.SendJob) -> SendResult:
    wakeup = Wakeup(
        push_id=job.push_id,
        token=registration.token,
        account=registration.device_hash,
        channel=registration.room_hash,
        important=job.important,
        message_count=job.message_count,
        pending_subscription_count=job.pending_subscription_count,
    )
    try:
        provider = registry.provider_for(registration.app, registration.service)
    except registry.NotConfigured as error:
        return SendResult(Outcome.FAILED, error_code=error.code)
    try:
        return provider.send(wakeup)
    except Exception as error:  # a provider must classify; a crash is treated as passing trouble
        log.exception("delivery.provider_crashed", extra={"error_type": type(error).__name__})
        return SendResult(Outcome.RETRY_LATER, error_code="INTERNAL")


def deliver(job: queue.SendJob) -> Outcome:
    registration = Registration.objects.select_related("app").filter(pk=job.registration_id).first()
    if registration is None:
        log.info("delivery.registration_gone", extra={"push_id": job.push_id})
        return Outcome.FAILED
    if registration.dead_since is not None:
        result = SendResult(Outcome.DEAD_TOKEN, error_code="ALREADY_DEAD")
    else:
        result = _send(registration, job)
    now = timezone.now()
    if result.outcome == Outcome.RETRY_LATER:
        if (
            job.attempt < settings.RELAY["SEND_MAX_ATTEMPTS"]
            and _age_seconds(job, now) < settings.RELAY["SEND_MAX_AGE_SECONDS"]
        ):
            try:
                queue.enqueue_send(
                    dataclasses.replace(job, attempt=job.attempt + 1),
                    countdown=retry_delay(job.attempt, result.retry_after),
                )
                log.info(
                    "delivery.retry_scheduled",
                    extra={
                        "push_id": job.push_id,
                        "attempt": job.attempt,
                        "code": result.error_code,
                    },
                )
                return Outcome.RETRY_LATER
            except queue.QueueUnavailable:
                result = SendResult(Outcome.FAILED, error_code="RETRY_NOT_QUEUED")
        else:
            result = SendResult(Outcome.FAILED, error_code=result.error_code or "RETRIES_EXHAUSTED")
    if result.outcome == Outcome.DEAD_TOKEN:
        Registration.objects.filter(pk=registration.pk, dead_since__isnull=True).update(
            dead_since=now
        )
    if result.outcome == Outcome.DELIVERED:
        stale = now - timezone.timedelta(seconds=LAST_PUSH_RESOLUTION_SECONDS)
        Registration.objects.filter(
            Q(last_push__isnull=True) | Q(last_push__lt=stale), pk=registration.pk
        ).update(last_push=now)
    _record(registration, job, result, now)
    log.info(
        "delivery.done",
        extra={
            "push_id": job.push_id,
            "provider": registration.service,
            "outcome": result.outcome.value,
            "code": result.error_code,
            "attempt": job.attempt,
        },
    )
    return result.outcome


def _record(
    registration: Registration, job: queue.SendJob, result: SendResult, now: datetime
) -> None:
    """One row per push; a redelivered job with the same push id adds nothing."""
    Delivery.objects.bulk_create(
        [
            Delivery(
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
            )
        ],
        ignore_conflicts=True,
    )
