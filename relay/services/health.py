"""Is the service able to do its job: database and broker reachable."""

from __future__ import annotations

from celery import current_app as celery_app
from django.db import connection


def database_reachable() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except Exception:
        return False


def broker_reachable() -> bool:
    try:
        with celery_app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
        return True
    except Exception:
        return False


def readiness() -> dict[str, bool]:
    return {"database": database_reachable(), "broker": broker_reachable()}
