"""Replaying dead letters: pushes that ran out of retries, were too old, or failed outright.

A replay queues the stored job again with the SAME push id (so the provider and the Delivery
record can tell it from a new push), as a first attempt whose age limit counts from the replay.
A dead letter replayed and failing again becomes a dead letter again (the same row).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from datetime import datetime

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from relay import metrics
from relay.models import DeadLetter
from relay.services import queue

log = logging.getLogger(__name__)


def pending(
    *,
    tenant: str | None = None,
    app: str | None = None,
    provider: str | None = None,
    reason: str | None = None,
    since: datetime | None = None,
) -> QuerySet[DeadLetter]:
    """Dead letters not yet replayed, oldest first, narrowed by tenant and app name, provider,
    reason (a substring: reasons carry the provider's code, e.g. "too old: THROTTLED") and
    creation time."""
    letters = DeadLetter.objects.filter(replayed__isnull=True)
    if tenant:
        letters = letters.filter(tenant__name=tenant)
    if app:
        letters = letters.filter(app__name=app)
    if provider:
        letters = letters.filter(provider=provider)
    if reason:
        letters = letters.filter(reason__contains=reason)
    if since is not None:
        letters = letters.filter(created__gte=since)
    return letters.order_by("pk")


def replay(*, dead_letter_ids: Iterable[int]) -> int:
    """Re-queue the given dead letters not yet replayed; returns how many were queued.

    Stops at the first one the broker refuses (raising QueueUnavailable) so the operator sees
    it; those already queued stay marked as replayed.
    """
    ids = list(dead_letter_ids)
    replayed = 0
    for letter in DeadLetter.objects.filter(pk__in=ids, replayed__isnull=True).order_by("pk"):
        with transaction.atomic():
            # Claim the row first: two operators clicking at once queue it once.
            claimed = DeadLetter.objects.filter(pk=letter.pk, replayed__isnull=True).update(
                replayed=timezone.now()
            )
            if not claimed:
                continue
            job = dataclasses.replace(
                queue.SendJob.from_message(letter.job),
                attempt=1,
                coalesced=False,
                queued="",
                replayed=timezone.now().isoformat(),
            )
            queue.enqueue_send(job)  # QueueUnavailable rolls the claim back
        replayed += 1
        metrics.DEAD_LETTERS_REPLAYED.inc()
        log.info("dead_letter.replayed", extra={"push_id": job.push_id})
    return replayed
