"""Selectors over the report aggregates for the admin's reports page (scoped by tenant).

`tenant_ids` None is the operator (every tenant, and the all-tenants totals); a set confines
every figure to those tenants, built from their own rows only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from datetime import date, timedelta

from django.db.models import Max, QuerySet, Sum
from django.utils import timezone

from relay.report_models import (
    ReportAnomaly,
    ReportDomain,
    ReportErrorCode,
    ReportLevel,
    ReportRegistrations,
    ReportUsage,
)
from relay.services.usage import Counts, DayCounts

_COUNTS = ("publishes_received", "pushes_sent", "delivered", "dead_tokens", "failed")


@dataclass(frozen=True, slots=True)
class LatencyDay:
    day: date
    p50: float | None
    p95: float | None
    p99: float | None


def _scoped(queryset: QuerySet, tenant_ids: Collection[int] | None) -> QuerySet:
    if tenant_ids is None:
        return queryset
    return queryset.filter(tenant_id__in=tenant_ids)


def daily_usage(
    *,
    tenant_ids: Collection[int] | None,
    days: int = 30,
    today: date | None = None,
    provider: str | None = None,
) -> list[DayCounts]:
    """Pushes per reported day, oldest first, for the admin's stacked bar chart: every
    provider's, or one provider's (e.g. `up`, the UnifiedPush messages)."""
    today = today or timezone.now().date()
    first = today - timedelta(days=days - 1)
    level = ReportUsage.objects.filter(
        level=ReportLevel.TENANT if provider is None else ReportLevel.PROVIDER, day__gte=first
    )
    if provider is not None:
        level = level.filter(provider=provider)
    rows = (
        _scoped(level, tenant_ids).values("day").annotate(**{name: Sum(name) for name in _COUNTS})
    )
    by_day = {row["day"]: row for row in rows}
    result = []
    for offset in range(days):
        day = first + timedelta(days=offset)
        row = by_day.get(day)
        counts = (
            Counts(row["pushes_sent"], row["delivered"], row["dead_tokens"], row["failed"])
            if row
            else Counts()
        )
        result.append(DayCounts(day, counts))
    return result


def latency(*, tenant_ids: Collection[int] | None, days: int = 30) -> list[LatencyDay]:
    """The operator's all-tenant percentiles; a tenant's own (one tenant: its rows)."""
    first = timezone.now().date() - timedelta(days=days - 1)
    if tenant_ids is None:
        rows = ReportUsage.objects.filter(level=ReportLevel.ALL, day__gte=first)
    elif len(tenant_ids) == 1:
        rows = ReportUsage.objects.filter(
            level=ReportLevel.TENANT, day__gte=first, tenant_id__in=tenant_ids
        )
    else:  # percentiles of several tenants do not add up: show none rather than a wrong one
        return []
    return [
        LatencyDay(row.day, row.latency_p50_ms, row.latency_p95_ms, row.latency_p99_ms)
        for row in rows.order_by("day")
    ]


def usage_per_tenant(*, tenant_ids: Collection[int] | None, days: int = 30) -> list[dict]:
    first = timezone.now().date() - timedelta(days=days - 1)
    return list(
        _scoped(ReportUsage.objects.filter(level=ReportLevel.TENANT, day__gte=first), tenant_ids)
        .values("tenant_id", "tenant_name")
        .annotate(
            **{name: Sum(name) for name in (*_COUNTS, "rate_limited", "coalesced", "refused")}
        )
        .order_by("tenant_name")
    )


def usage_per_provider(*, tenant_ids: Collection[int] | None, days: int = 30) -> list[dict]:
    """Per tenant and provider (UnifiedPush as `up`), the last `days` days."""
    first = timezone.now().date() - timedelta(days=days - 1)
    return list(
        _scoped(ReportUsage.objects.filter(level=ReportLevel.PROVIDER, day__gte=first), tenant_ids)
        .values("tenant_id", "tenant_name", "provider")
        .annotate(**{name: Sum(name) for name in (*_COUNTS, "bytes_relayed")})
        .order_by("tenant_name", "provider")
    )


def latest_registrations(*, tenant_ids: Collection[int] | None) -> tuple[date | None, list]:
    queryset = _scoped(ReportRegistrations.objects.all(), tenant_ids)
    last = queryset.aggregate(last=Max("day"))["last"]
    if last is None:
        return None, []
    return last, list(queryset.filter(day=last).order_by("tenant_name", "app_name", "provider"))


def top_domains(*, tenant_ids: Collection[int] | None) -> tuple[date | None, list]:
    queryset = _scoped(ReportDomain.objects.all(), tenant_ids)
    last = queryset.aggregate(last=Max("day"))["last"]
    if last is None:
        return None, []
    return last, list(queryset.filter(day=last).order_by("tenant_name", "rank_by_volume"))


def error_codes(*, tenant_ids: Collection[int] | None, days: int = 7) -> list[dict]:
    first = timezone.now().date() - timedelta(days=days - 1)
    totals: dict[tuple[str, str, str, str], int] = defaultdict(int)
    for row in _scoped(ReportErrorCode.objects.filter(day__gte=first), tenant_ids):
        totals[(row.tenant_name, row.provider, row.outcome, row.error_code)] += row.count
    return [
        {"tenant": k[0], "provider": k[1], "outcome": k[2], "error_code": k[3], "count": v}
        for k, v in sorted(totals.items(), key=lambda item: -item[1])
    ]


def anomalies(*, tenant_ids: Collection[int] | None, days: int = 30) -> list[ReportAnomaly]:
    first = timezone.now().date() - timedelta(days=days - 1)
    return list(
        _scoped(ReportAnomaly.objects.filter(day__gte=first), tenant_ids).order_by(
            "-day", "tenant_name"
        )
    )
