"""Pruning the records the reports are made of once they are older than RELAY_RETENTION_DAYS.

Deleted in small id ranges, each its own short transaction, so no lock is held for long and
the relay keeps writing meanwhile. The daily report aggregates are kept (they are small, and
they are what tenants are billed on): before deleting, each table's cut is recorded
(`RetentionCut`), and the reports never recompute a day the cut reaches into.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import models, transaction
from django.db.models import Max, Min
from django.utils import timezone

from relay import conf
from relay.models import Delivery
from relay.report_models import PublishTally, RegistrationEvent, RetentionCut

log = logging.getLogger(__name__)

# (model, its time field): what the retention applies to; feature apps add theirs.
PRUNED: list[tuple[type[models.Model], str]] = [
    (Delivery, "received"),
    (RegistrationEvent, "at"),
    (PublishTally, "minute"),
]


def register_pruned(model: type[models.Model], field: str) -> None:
    """A feature app's record kept for RELAY_RETENTION_DAYS like the core's, declared in its
    AppConfig.ready (`field`: its time)."""
    if (model, field) not in PRUNED:
        PRUNED.append((model, field))


@dataclass(frozen=True, slots=True)
class Progress:
    table: str
    deleted: int
    done_ids: int
    total_ids: int


def prune_table(
    model: type[models.Model],
    field: str,
    *,
    cutoff: datetime,
    batch_size: int = 10_000,
    progress: Callable[[Progress], None] | None = None,
) -> int:
    """Delete `model` rows whose `field` is before `cutoff`, one id range at a time."""
    old = model._default_manager.filter(**{f"{field}__lt": cutoff})
    bounds = old.aggregate(low=Min("id"), high=Max("id"))
    low, high = bounds["low"], bounds["high"]
    if low is None:
        return 0
    record_cut(model._meta.db_table, cutoff)
    deleted = 0
    start = low
    while start <= high:
        end = min(start + batch_size - 1, high)
        # Nothing references these rows: Django deletes them in one statement.
        count, _ = old.filter(id__gte=start, id__lte=end).delete()
        deleted += count
        if progress is not None:
            progress(Progress(model._meta.db_table, deleted, end - low + 1, high - low + 1))
        start = end + 1
    log.info("retention.pruned", extra={"table": model._meta.db_table, "rows": deleted})
    return deleted


def record_cut(table: str, cutoff: datetime) -> None:
    """Move `table`'s cut to `cutoff` (never back): committed before any row goes."""
    with transaction.atomic():
        cut, created = RetentionCut.objects.select_for_update().get_or_create(
            table_name=table, defaults={"pruned_before": cutoff}
        )
        if not created and cut.pruned_before < cutoff:
            cut.pruned_before = cutoff
            cut.save(update_fields=["pruned_before"])


def prune(
    *,
    days: int | None = None,
    now: datetime | None = None,
    batch_size: int = 10_000,
    progress: Callable[[Progress], None] | None = None,
) -> dict[str, int]:
    """Prune every report source older than `days` (default RELAY_RETENTION_DAYS; 0 or less
    keeps everything). Returns the rows deleted per table."""
    days = conf.current().retention_days if days is None else days
    if days <= 0:
        return {}
    cutoff = (now or timezone.now()) - timedelta(days=days)
    return {
        model._meta.db_table: prune_table(
            model, field, cutoff=cutoff, batch_size=batch_size, progress=progress
        )
        for model, field in PRUNED
    }
