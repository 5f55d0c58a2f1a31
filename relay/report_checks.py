"""System checks for the reports: a retention too short for the monthly export, and an
analytics database the Spark jobs cannot read (they need PostgreSQL)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Warning, register

from relay import conf

# The monthly usage export needs the whole previous month still on record.
MIN_RETENTION_DAYS = 62


@register("relay")
def reports_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    days = conf.current().retention_days
    if 0 < days < MIN_RETENTION_DAYS:
        messages.append(
            Warning(
                f"RELAY_RETENTION_DAYS={days} prunes records before the monthly usage export "
                "of the previous month can be made.",
                hint=f"Keep at least {MIN_RETENTION_DAYS} days (0 keeps everything).",
                id="relay.W101",
            )
        )
    url = conf.current().analytics_database_url
    if url and not url.startswith(("postgres://", "postgresql://")):
        messages.append(
            Warning(
                "ANALYTICS_DATABASE_URL is not a PostgreSQL URL: the reports read over the "
                "PostgreSQL JDBC driver only.",
                hint="Point it at a read replica: postgres://user@replica:5432/push",
                id="relay.W102",
            )
        )
    return messages
