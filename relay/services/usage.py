"""Selectors for the admin's usage and health pages: counts, never contents.

Every selector takes `tenant_ids` (None means every tenant) so a tenant's own staff see their
numbers only. A push counts as received once its send finished (one `Delivery` row each).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

from celery import current_app as celery_app
from django.db.models import Count, Q, QuerySet
from django.db.models.functions import TruncDate
from django.utils import timezone

from relay.models import Component, DeadLetter, Delivery, LinkState, Service
from relay.providers.base import Outcome

log = logging.getLogger(__name__)

DAY = timedelta(days=1)
MONTH = timedelta(days=30)
HOUR = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class Counts:
    received: int = 0
    delivered: int = 0
    dead: int = 0
    failed: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.received + other.received,
            self.delivered + other.delivered,
            self.dead + other.dead,
            self.failed + other.failed,
        )

    @property
    def delivered_percent(self) -> float | None:
        return round(100 * self.delivered / self.received, 1) if self.received else None


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One tenant's app through one provider, over the last day and the last 30 days."""

    tenant_id: int
    tenant: str
    app_id: int
    app: str
    provider: str
    day: Counts
    month: Counts


@dataclass(frozen=True, slots=True)
class DayCounts:
    day: date
    counts: Counts


@dataclass(frozen=True, slots=True)
class ProviderRate:
    provider: str
    counts: Counts

    @property
    def failed_percent(self) -> float | None:
        total = self.counts.received
        return round(100 * self.counts.failed / total, 1) if total else None

    @property
    def dead_percent(self) -> float | None:
        total = self.counts.received
        return round(100 * self.counts.dead / total, 1) if total else None


@dataclass(frozen=True, slots=True)
class LinkRow:
    component_id: int
    jid: str
    tenant: str
    enabled: bool
    state: str
    since: datetime | None
    last_error: str
    last_error_at: datetime | None
    pushes_last_hour: int


@dataclass(slots=True)
class LinkOverview:
    states: dict[str, int] = field(default_factory=dict)
    links: list[LinkRow] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.states.values())


def _deliveries(tenant_ids: Collection[int] | None) -> QuerySet[Delivery]:
    queryset = Delivery.objects.all()
    if tenant_ids is not None:
        queryset = queryset.filter(tenant_id__in=tenant_ids)
    return queryset


def _count_expressions(prefix: str = "", since: datetime | None = None) -> dict[str, Count]:
    window = Q(received__gte=since) if since is not None else Q()
    return {
        f"{prefix}received": Count("id", filter=window),
        f"{prefix}delivered": Count("id", filter=window & Q(outcome=Outcome.DELIVERED)),
        f"{prefix}dead": Count("id", filter=window & Q(outcome=Outcome.DEAD_TOKEN)),
        f"{prefix}failed": Count("id", filter=window & Q(outcome=Outcome.FAILED)),
    }


def _counts(row: Mapping[str, Any], prefix: str = "") -> Counts:
    return Counts(
        row[f"{prefix}received"],
        row[f"{prefix}delivered"],
        row[f"{prefix}dead"],
        row[f"{prefix}failed"],
    )


def usage_table(
    *,
    tenant_ids: Collection[int] | None,
    app_ids: Collection[int] | None = None,
    now: datetime | None = None,
) -> list[UsageRow]:
    """Per tenant, app and provider: the last day and the last 30 days, in one query."""
    now = now or timezone.now()
    queryset = _deliveries(tenant_ids).filter(received__gte=now - MONTH, received__lte=now)
    if app_ids is not None:
        queryset = queryset.filter(app_id__in=app_ids)
    rows = (
        queryset.values("tenant_id", "tenant__name", "app_id", "app__name", "provider")
        .annotate(**_count_expressions("day_", now - DAY), **_count_expressions("month_"))
        .order_by("tenant__name", "app__name", "provider")
    )
    return [
        UsageRow(
            tenant_id=row["tenant_id"],
            tenant=row["tenant__name"],
            app_id=row["app_id"],
            app=row["app__name"],
            provider=row["provider"],
            day=_counts(row, "day_"),
            month=_counts(row, "month_"),
        )
        for row in rows
    ]


def totals(rows: Collection[UsageRow]) -> tuple[Counts, Counts]:
    """The last day's and the last 30 days' sums of some usage rows."""
    day, month = Counts(), Counts()
    for row in rows:
        day, month = day + row.day, month + row.month
    return day, month


def daily_counts(
    *,
    tenant_ids: Collection[int] | None,
    app_ids: Collection[int] | None = None,
    days: int = 30,
    now: datetime | None = None,
) -> list[DayCounts]:
    """One entry per UTC day, oldest first, days without pushes included (for the chart)."""
    now = now or timezone.now()
    first = (now - timedelta(days=days - 1)).date()
    queryset = _deliveries(tenant_ids).filter(received__date__gte=first, received__lte=now)
    if app_ids is not None:
        queryset = queryset.filter(app_id__in=app_ids)
    rows = (
        queryset.annotate(day=TruncDate("received", tzinfo=timezone.get_current_timezone()))
        .values("day")
        .annotate(**_count_expressions())
        .order_by("day")
    )
    by_day = {row["day"]: _counts(row) for row in rows}
    return [
        DayCounts(day, by_day.get(day, Counts()))
        for day in (first + timedelta(days=offset) for offset in range(days))
    ]


def provider_rates(
    *, tenant_ids: Collection[int] | None, since: datetime | None = None
) -> list[ProviderRate]:
    """Outcomes per provider since a time (default: the last hour), every provider listed."""
    since = since or timezone.now() - HOUR
    rows = (
        _deliveries(tenant_ids)
        .filter(received__gte=since)
        .values("provider")
        .annotate(**_count_expressions())
    )
    by_provider = {row["provider"]: _counts(row) for row in rows}
    return [
        ProviderRate(service.value, by_provider.get(service.value, Counts())) for service in Service
    ]


def pushes_last_hour(*, component_ids: Collection[int]) -> dict[int, int]:
    """Pushes per component in the last hour (through the registrations they came in on)."""
    if not component_ids:
        return {}
    rows = (
        Delivery.objects.filter(
            received__gte=timezone.now() - HOUR, registration__component_id__in=component_ids
        )
        .values("registration__component_id")
        .annotate(pushes=Count("id"))
    )
    return {row["registration__component_id"]: row["pushes"] for row in rows}


def link_overview(*, tenant_ids: Collection[int] | None) -> LinkOverview:
    """Every component's link as the gateway last reported it; `unknown` before its first try."""
    components = Component.objects.select_related("tenant", "link").order_by("jid")
    if tenant_ids is not None:
        components = components.filter(tenant_id__in=tenant_ids)
    listed = list(components)
    pushes = pushes_last_hour(component_ids=[component.pk for component in listed])
    overview = LinkOverview(
        states={state: 0 for state in [*LinkState.values, "unknown", "disabled"]}
    )
    for component in listed:
        link = getattr(component, "link", None)
        if not component.enabled:
            state = "disabled"
        else:
            state = link.state if link is not None else "unknown"
        overview.states[state] += 1
        overview.links.append(
            LinkRow(
                component_id=component.pk,
                jid=component.jid,
                tenant=str(component.tenant),
                enabled=component.enabled,
                state=state,
                since=link.since if link is not None else None,
                last_error=link.last_error if link is not None else "",
                last_error_at=link.last_error_at if link is not None else None,
                pushes_last_hour=pushes.get(component.pk, 0),
            )
        )
    return overview


def dead_letters_waiting(*, tenant_ids: Collection[int] | None) -> int:
    queryset = DeadLetter.objects.filter(replayed__isnull=True)
    if tenant_ids is not None:
        queryset = queryset.filter(tenant_id__in=tenant_ids)
    return queryset.count()


def queue_depth() -> int | None:
    """Send jobs waiting in the broker (delayed retries held by workers are not counted).

    None when the broker cannot be asked; the health page then says so.
    """
    try:
        with celery_app.connection_for_read() as connection:
            connection.ensure_connection(max_retries=1, timeout=2)
            channel = connection.default_channel
            try:
                declared = channel.queue_declare(celery_app.conf.task_default_queue, passive=True)
            except Exception:  # the queue does not exist yet: nothing was ever sent
                return 0
            return int(declared.message_count)
    except Exception as error:
        log.warning("usage.queue_depth_unavailable", extra={"error_type": type(error).__name__})
        return None
