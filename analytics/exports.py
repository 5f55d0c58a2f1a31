"""The monthly usage export per tenant: one CSV per tenant and month, the figures a hosting
provider bills on (publishes received, pushes sent and delivered, live registrations)."""

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
    "publishes_received",
    "pushes_sent",
    "delivered",
    "dead_tokens",
    "failed",
    "rate_limited",
    "coalesced",
    "refused",
    "registrations_peak",
    "registrations_at_month_end",
)
_SUMMED = COLUMNS[6:14]


def month_bounds(day: date) -> tuple[date, date]:
    return day.replace(day=1), day.replace(day=monthrange(day.year, day.month)[1])


def months_of(days: Iterable[date]) -> list[date]:
    return sorted({day.replace(day=1) for day in days})


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "tenant"


def write_month(
    export_dir: Path,
    month: date,
    usage_rows: Iterable[dict[str, Any]],
    registration_rows: Iterable[dict[str, Any]],
) -> list[Path]:
    """One CSV per tenant for `month` from the month's provider-level usage and registration
    rows; a last line per tenant sums its apps. Returns the files written."""
    first, last = month_bounds(month)
    rows: dict[tuple[str, str, str], dict[str, Any]] = defaultdict(
        lambda: {"days": set(), **dict.fromkeys(_SUMMED, 0), "peak": 0, "end": (None, 0)}
    )
    for row in usage_rows:
        if row["level"] != "provider" or not first <= row["day"] <= last:
            continue
        entry = rows[(row["tenant_name"], row["app_name"], row["provider"])]
        entry["days"].add(row["day"])
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
    by_tenant: dict[str, list[tuple[str, str, dict[str, Any]]]] = defaultdict(list)
    for (tenant, app, provider), entry in sorted(rows.items()):
        by_tenant[tenant].append((app, provider, entry))
    folder = export_dir / "monthly" / f"{month:%Y-%m}"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for tenant, entries in by_tenant.items():
        path = folder / f"{_safe(tenant)}.csv"
        total = dict.fromkeys(_SUMMED, 0) | {"peak": 0, "end": 0, "days": set()}
        with path.open("w", newline="") as handle:
            out = csv.writer(handle)
            out.writerow(COLUMNS)
            for app, provider, entry in entries:
                out.writerow(_line(month, tenant, app, provider, entry, last))
                for column in _SUMMED:
                    total[column] += entry[column]
                total["days"] |= entry["days"]
            # The tenant's own peak: its apps' live registrations summed per day.
            active = tenant_days.get(tenant, {})
            total["peak"] = max(active.values(), default=0)
            total["end"] = (None, active[max(active)] if active else 0)
            out.writerow(_line(month, tenant, "(all)", "(all)", total, last))
        written.append(path)
    return written


def _line(
    month: date, tenant: str, app: str, provider: str, entry: dict[str, Any], last: date
) -> list[Any]:
    return [
        f"{month:%Y-%m}",
        tenant,
        app,
        provider,
        len(entry["days"]),
        last.day,
        *(entry[column] for column in _SUMMED),
        entry["peak"],
        entry["end"][1],
    ]
