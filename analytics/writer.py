"""Loads the daily aggregates into the primary database, where the admin reads them.

The only place the reports write to the relay's database, and only to the report tables
(relay/report_models.py; UnifiedPush's in relay/unifiedpush/models.py). Each load replaces
the given days in one transaction, so a re-run is idempotent and the admin never sees half a
day.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import date
from typing import Any

from analytics.config import Database
from analytics.schema import COUNT_COLUMNS, UNIFIEDPUSH_OUTCOMES

# table -> columns, in the order rows are inserted (ids are the database's).
TABLES: dict[str, tuple[str, ...]] = {
    "relay_reportusage": (
        "day",
        "level",
        "tenant_id",
        "tenant_name",
        "app_id",
        "app_name",
        "provider",
        *COUNT_COLUMNS,
        "success_rate",
        "latency_p50_ms",
        "latency_p95_ms",
        "latency_p99_ms",
    ),
    "relay_reportregistrations": (
        "day",
        "tenant_id",
        "tenant_name",
        "app_id",
        "app_name",
        "provider",
        "active",
        "new",
        "renewed",
        "died",
        "removed",
    ),
    "relay_reportdomain": (
        "day",
        "tenant_id",
        "tenant_name",
        "publishing_domain",
        "publishes_received",
        "pushes_sent",
        "failed",
        "failure_rate",
        "rank_by_volume",
        "rank_by_failure_rate",
    ),
    "relay_reporterrorcode": (
        "day",
        "tenant_id",
        "tenant_name",
        "app_id",
        "app_name",
        "provider",
        "outcome",
        "error_code",
        "count",
    ),
    "relay_reportunifiedpush": (
        "day",
        "tenant_id",
        "tenant_name",
        "component_id",
        "component_name",
        "received",
        *UNIFIEDPUSH_OUTCOMES,
        "bytes_relayed",
    ),
    "relay_reportanomaly": (
        "day",
        "scope",
        "tenant_id",
        "tenant_name",
        "app_id",
        "app_name",
        "publishing_domain",
        "metric",
        "value",
        "baseline",
        "threshold",
        "pushes_sent",
        "detail",
    ),
}


def load(
    db: Database, replacements: Sequence[tuple[str, Iterable[date], Iterable[dict[str, Any]]]]
) -> dict[str, int]:
    """For each (table, days, rows): delete the table's rows of those days, insert `rows`.
    All in one transaction. Returns the rows inserted per table."""
    inserted: dict[str, int] = {}
    with db.connect() as conn, conn.cursor() as cursor:
        for table, days, rows in replacements:
            columns = TABLES[table]
            day_list = sorted(set(days))
            if not day_list:
                continue
            cursor.execute(f"DELETE FROM {table} WHERE day = ANY(%s)", (day_list,))
            values = [tuple(row.get(column) for column in columns) for row in rows]
            if values:
                placeholders = ", ".join(["%s"] * len(columns))
                cursor.executemany(
                    f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({placeholders})", values
                )
            inserted[table] = inserted.get(table, 0) + len(values)
    return inserted
