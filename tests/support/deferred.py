"""Reading the deferred sends (relay/services/deferred.py) as the tests read the queue."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class DeferredJob:
    job: dict[str, Any]
    eta: datetime  # the row's due time: when the sweep queues it


def deferred_jobs() -> list[DeferredJob]:
    """The deferred sends waiting in the database, earliest due first (left in place)."""
    from relay.models import DeferredSend

    return [DeferredJob(row.job, row.due) for row in DeferredSend.objects.order_by("due", "pk")]


def swept(condition: Callable[[], bool]) -> Callable[[], bool]:
    """`condition`, checked after a sweep of the due deferred sends: for tests that need the
    sweep at once rather than at the next round of a worker's own sweeper."""

    def check() -> bool:
        from relay.services import deferred

        deferred.sweep()
        return condition()

    return check
