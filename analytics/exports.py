"""The monthly usage export per tenant: one CSV per tenant and month, the figures a hosting
provider bills on (publishes received, pushes sent and delivered, live registrations; for
UnifiedPush, provider `up`: messages received, delivered, and the body bytes relayed).

Every tenant gets its file, with zeros when it had no activity (a bill is never missing), and
each file says what it covers: the days the report runs covered, and `partial` when it was
written before the month ended or some of its days were never reported."""

from __future__ import annotations

import csv
import re
from calendar import monthrange
from collections import defaultdict
from collections.abc import Iterable
from datetime import date
from pathlib import Path
from typing import Any

COLUMNS = (
    "month",
    "tenant",
    "app",
    "provider",
    "days_reported",
    "days_in_month",
    "status",
    "days_covered",
    "publishes_received",
    "pushes_sent",
    "delivered",
    "dead_tokens",
    "failed",
    "rate_limited",
    "coalesced",
    "refused",
    "bytes_relayed",
    "registrations_peak",
    "registrations_at_month_end",
)
_SUMMED = COLUMNS[COLUMNS.index("publishes_received") : COLUMNS.index("registrations_peak")]


def month_bounds(day: date) -> tuple[date, date]:
    return day.replace(day=1), day.replace(day=monthrange(day.year, day.month)[1])


def months_of(days: Iterable[date]) -> list[date]:
    return sorted({day.replace(day=1) for day in days})


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "tenant"


def covered_ranges(days: Iterable[date]) -> str:
    """Days as ranges, e.g. `2026-11-01..2026-11-10 2026-11-12`."""
    ranges: list[list[date]] = []
    for day in sorted(set(days)):
        if ranges and (day - ranges[-1][1]).days == 1:
            ranges[-1][1] = day
        else:
            ranges.append([day, day])
    return " ".join(str(a) if a == b else f"{a}..{b}" for a, b in ranges)


def write_month(
    export_dir: Path,
    month: date,
    usage_rows: Iterable[dict[str, Any]],
    registration_rows: Iterable[dict[str, Any]],
    *,
    tenants: Iterable[str],
    reported: Iterable[date],
    today: date,
) -> list[Path]:
    """One CSV per tenant for `month` from the month's provider-level usage and registration
    rows; a last line per tenant sums its apps. `tenants`: every tenant (one without a row
    gets a file of zeros); `reported`: the days report runs covered (`days_reported`,
    `days_covered`); `today`: the day it is written (before the month's end: partial).
    Returns the files written."""
    first, last = month_bounds(month)
    covered = sorted(day for day in set(reported) if first <= day <= last)
    partial = today <= last or len(covered) < last.day
    coverage = {
        "days": len(covered),
        "status": "partial" if partial else "complete",
        "covered": covered_ranges(covered),
    }
    rows: dict[tuple[str, str, str], dict[str, Any]] = defaultdict(
        lambda: {**dict.fromkeys(_SUMMED, 0), "peak": 0, "end": (None, 0)}
    )
    for row in usage_rows:
        if row["level"] != "provider" or not first <= row["day"] <= last:
            continue
        entry = rows[(row["tenant_name"], row["app_name"], row["provider"])]
        for column in _SUMMED:
            entry[column] += row[column] or 0
    tenant_days: dict[str, dict[date, int]] = defaultdict(lambda: defaultdict(int))
    for row in registration_rows:
        if not first <= row["day"] <= last:
            continue
        tenant_days[row["tenant_name"]][row["day"]] += row["active"]
        entry = rows[(row["tenant_name"], row["app_name"], row["provider"])]
        entry["peak"] = max(entry["peak"], row["active"])
        if entry["end"][0] is None or row["day"] > entry["end"][0]:
            entry["end"] = (row["day"], row["active"])
    by_tenant: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
        tenant: [] for tenant in sorted(set(tenants))
    }
    for (tenant, app, provider), entry in sorted(rows.items()):
        by_tenant.setdefault(tenant, []).append((app, provider, entry))
    folder = export_dir / "monthly" / f"{month:%Y-%m}"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for tenant, entries in by_tenant.items():
        path = folder / f"{_safe(tenant)}.csv"
        total: dict[str, Any] = dict.fromkeys(_SUMMED, 0) | {"peak": 0, "end": (None, 0)}
        with path.open("w", newline="") as handle:
            out = csv.writer(handle)
            out.writerow(COLUMNS)
            for app, provider, entry in entries:
                out.writerow(_line(month, tenant, app, provider, entry, last, coverage))
                for column in _SUMMED:
                    total[column] += entry[column]
            # The tenant's own peak: its apps' live registrations summed per day.
            active = tenant_days.get(tenant, {})
            total["peak"] = max(active.values(), default=0)
            total["end"] = (None, active[max(active)] if active else 0)
            out.writerow(_line(month, tenant, "(all)", "(all)", total, last, coverage))
        written.append(path)
    return written


def _line(
    month: date,
    tenant: str,
    app: str,
    provider: str,
    entry: dict[str, Any],
    last: date,
    coverage: dict[str, Any],
) -> list[Any]:
    return [
        f"{month:%Y-%m}",
        tenant,
        app,
        provider,
        coverage["days"],
        last.day,
        coverage["status"],
        coverage["covered"],
        *(entry[column] for column in _SUMMED),
        entry["peak"],
        entry["end"][1],
    ]
