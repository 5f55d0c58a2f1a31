"""A primary PostgreSQL with the relay's schema, a streaming replica of it, and synthetic
records with known answers for the reports' tests (tests/test_analytics*.py).

Tenants, apps, components and registrations are made through the relay's own models (in a
`manage.py` process pointed at the private primary); deliveries, tallies and lifecycle events
are plain rows, written the way the relay writes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta
from datetime import time as clock
from pathlib import Path
from typing import Any

import psycopg

from tests.support.services import PrivatePostgres
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]

# What must never appear in any output (the registrations carry them, on purpose).
PRIVATE = ("TOKEN-PRIVATE", "NODE-PRIVATE", "SECRET-PRIVATE", "alice@", "HASH-PRIVATE")

D1, D2, D3 = date(2026, 3, 2), date(2026, 3, 3), date(2026, 3, 4)

_SETUP = """
import json, django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from relay.models import App, Component, Registration, Tenant
ids = {}
for tenant_name, app_name in (("alpha", "conv"), ("beta", "chat")):
    tenant = Tenant.objects.create(name=tenant_name)
    app = App.objects.create(tenant=tenant, name=app_name)
    component = Component.objects.create(
        tenant=tenant, app=app, jid=f"push.{tenant_name}.example", secret="SECRET-PRIVATE-c"
    )
    ids[tenant_name] = {"tenant": tenant.pk, "app": app.pk, "component": component.pk}
print(json.dumps(ids))
"""

_PRUNE = """
import json, sys, django
from datetime import datetime
django.setup()
from relay.services import retention
pruned = retention.prune(days=int(sys.argv[1]), now=datetime.fromisoformat(sys.argv[2]))
print(json.dumps(pruned))
"""


_TENANT = """
import json, sys, django
django.setup()
from relay.models import Tenant
print(json.dumps(Tenant.objects.create(name=sys.argv[1]).pk))
"""


def at(day: date, seconds: float = 3600.0) -> datetime:
    return datetime.combine(day, clock(), tzinfo=UTC) + timedelta(seconds=seconds)


class ReportDatabase:
    """The primary (where the relay writes and the reports load) and its replica (where the
    reports read)."""

    def __init__(self, workdir: Path) -> None:
        # Their own folders under /tmp: the postgres user cannot enter pytest's.
        self.primary = PrivatePostgres().start()
        self.url = self.primary.create_database("relay")
        self._env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "pushsite.settings",
            "DATABASE_URL": self.url,
            "VAR_DIR": str(workdir / "var"),
        }
        self.ids: dict[str, dict[str, int]] = self._relay(_SETUP)
        # pg_basebackup starts with a spread checkpoint: with the buffers already written it
        # has nothing to pace, and the replica is there in a second instead of minutes.
        self.primary.psql("CHECKPOINT")
        self.replica = self.primary.replica()
        self.replica_url = self.replica.url("relay")
        self._registration = 0

    def _relay(self, code: str, *args: str) -> Any:
        """Run `code` in a Django process of the relay on the primary; its last line (JSON)."""
        out = subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=ROOT,
            env=self._env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        return json.loads(out.strip().splitlines()[-1])

    def tenant(self, name: str) -> int:
        """One more tenant, made by the relay's model (no app, no activity)."""
        return int(self._relay(_TENANT, name))

    def prune(self, days: int, now: datetime) -> dict[str, int]:
        """The relay's retention (relay.services.retention.prune) as if it were `now`."""
        return dict(self._relay(_PRUNE, str(days), now.isoformat()))

    def close(self) -> None:
        self.replica.close()
        self.primary.close()

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.url, autocommit=True)

    def execute(self, sql: str, params: Any = None) -> None:
        with self.connect() as conn:
            conn.execute(sql, params)

    def rows(self, sql: str, params: Any = None, *, replica: bool = False) -> list[tuple]:
        with psycopg.connect(self.replica_url if replica else self.url) as conn:
            return conn.execute(sql, params).fetchall()

    def wait_for_replica(self, timeout: float = 60.0) -> None:
        """Until the replica has replayed everything the primary wrote so far: up to the
        insert position (with synchronous_commit off, a commit can still be in the WAL
        buffers, past pg_current_wal_lsn(), when its statement returns)."""
        [(lsn,)] = self.rows("SELECT pg_current_wal_insert_lsn()::text")

        def replayed() -> bool:
            [(done,)] = self.rows(
                "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,), replica=True
            )
            return bool(done)

        wait_until(replayed, timeout, "the replica catches up")

    # --- records ---------------------------------------------------------------------------

    def deliveries(self, tenant: str, provider: str, rows: list[dict[str, Any]]) -> None:
        ids = self.ids[tenant]
        with self.connect() as conn, conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO relay_delivery (push_id, tenant_id, app_id, provider, "
                "publishing_domain, priority, received, queued, sent, attempts, outcome, "
                "error_code, coalesced) VALUES (gen_random_uuid(), %s, %s, %s, %s, 'high', "
                "%s, %s, %s, %s, %s, %s, 0)",
                [
                    (
                        ids["tenant"],
                        ids["app"],
                        provider,
                        row["domain"],
                        row["received"],
                        row["received"],
                        row["received"] + timedelta(milliseconds=row["latency"])
                        if row["outcome"] == "delivered"
                        else None,
                        row.get("attempts", 1),
                        row["outcome"],
                        row.get("code", ""),
                    )
                    for row in rows
                ],
            )

    def unifiedpush(self, tenant: str, rows: list[dict[str, Any]]) -> None:
        """UnifiedPush messages as the UnifiedPush app records them once they ended (a POST or
        a Matrix gateway notification alike): outcome, sizes, POST and answer times."""
        ids = self.ids[tenant]
        with self.connect() as conn, conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO relay_unifiedpushdelivery (tenant_id, component_id, outcome, "
                "urgency, received, finished, size, ttl, attempts) "
                "VALUES (%s, %s, %s, 2, %s, %s, %s, 3600, %s)",
                [
                    (
                        ids["tenant"],
                        ids["component"],
                        row["outcome"],
                        row["received"],
                        row["received"] + timedelta(milliseconds=row.get("latency", 0)),
                        row.get("size", 100),
                        row.get("attempts", 1),
                    )
                    for row in rows
                ],
            )

    def tally(
        self, tenant: str, provider: str, domain: str, verdict: str, count: int, minute: datetime
    ) -> None:
        ids = self.ids[tenant]
        self.execute(
            "INSERT INTO relay_publishtally (minute, tenant_id, app_id, provider, "
            "publishing_domain, verdict, count) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (minute, ids["tenant"], ids["app"], provider, domain, verdict, count),
        )

    def registration(self, tenant: str, provider: str, *, dead: bool = False) -> int:
        """A registration row as the relay keeps it (token, node, secret and hash included)."""
        ids = self.ids[tenant]
        self._registration += 1
        n = self._registration
        [(reg_id,)] = self.rows(
            "INSERT INTO relay_registration (app_id, component_id, service, device_hash, "
            "room_hash, account_domain, token, node, secret, created, updated, dead_since) "
            "VALUES (%s, %s, %s, %s, '', 'alice@example', %s, %s, %s, now(), now(), %s) "
            "RETURNING id",
            (
                ids["app"],
                ids["component"],
                provider,
                f"HASH-PRIVATE-{n}",
                f"TOKEN-PRIVATE-{n}",
                f"NODE-PRIVATE-{n}",
                f"SECRET-PRIVATE-{n}",
                datetime.now(UTC) if dead else None,
            ),
        )
        return reg_id

    def event(
        self,
        tenant: str,
        provider: str,
        registration_id: int,
        kind: str,
        change: int,
        when: datetime,
    ) -> None:
        ids = self.ids[tenant]
        self.execute(
            "INSERT INTO relay_registrationevent (at, tenant_id, app_id, provider, "
            "registration_id, kind, live_change) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (when, ids["tenant"], ids["app"], provider, registration_id, kind, change),
        )


def delivered(domain: str, latencies: list[int], day: date, **extra: Any) -> list[dict]:
    return [
        {
            "domain": domain,
            "received": at(day, 60 * i),
            "latency": ms,
            "outcome": "delivered",
            **extra,
        }
        for i, ms in enumerate(latencies)
    ]


def not_delivered(
    domain: str, outcome: str, code: str, n: int, day: date, **extra: Any
) -> list[dict]:
    return [
        {
            "domain": domain,
            "received": at(day, 7200 + i),
            "latency": 0,
            "outcome": outcome,
            "code": code,
            **extra,
        }
        for i in range(n)
    ]


def load_known_days(db: ReportDatabase) -> None:
    """D1 both tenants, D2 beta only, D3 nothing: the answers are in test_analytics.py."""
    # alpha / conv / fcm on D1: 7 delivered (2 after a retry), 1 dead token, 2 failed (1 retry)
    db.deliveries(
        "alpha",
        "fcm",
        delivered("a.example", [100, 200, 300, 400, 500], D1)
        + delivered("b.example", [600, 700], D1, attempts=2)
        + not_delivered("b.example", "dead_token", "UNREGISTERED", 1, D1)
        + not_delivered("b.example", "failed", "SENDER_ID_MISMATCH", 1, D1)
        + not_delivered("b.example", "failed", "SENDER_ID_MISMATCH", 1, D1, attempts=3),
    )
    db.deliveries("alpha", "apns", delivered("a.example", [50, 60, 70, 80], D1))
    db.deliveries(
        "beta",
        "fcm",
        delivered("c.example", [1000, 2000, 3000], D1)
        + not_delivered("c.example", "failed", "QUOTA_EXCEEDED", 2, D1),
    )
    minute = at(D1, 120)
    db.tally("alpha", "fcm", "a.example", "accepted", 10, minute)
    db.tally("alpha", "fcm", "a.example", "coalesced", 3, minute)
    db.tally("alpha", "fcm", "a.example", "rate-limited", 2, at(D1, 180))
    db.tally("alpha", "", "x.example", "unknown-node", 4, minute)
    db.tally("beta", "fcm", "c.example", "accepted", 5, minute)
    db.tally("beta", "fcm", "c.example", "unavailable", 1, minute)
    db.tally("beta", "fcm", "c.example", "forbidden", 1, minute)
    # D2: beta only
    db.deliveries("beta", "fcm", delivered("c.example", [10, 20, 30], D2))

    # Registrations: alpha/fcm 3 created on D1, one renewed, one died (2 live now);
    # alpha/apns one from before (no event); beta/fcm 2 created on D1, one removed on D2.
    regs = [db.registration("alpha", "fcm") for _ in range(2)]
    regs.append(db.registration("alpha", "fcm", dead=True))
    for reg in regs:
        db.event("alpha", "fcm", reg, "created", 1, at(D1, 100))
    db.event("alpha", "fcm", regs[0], "renewed", 0, at(D1, 200))
    db.event("alpha", "fcm", regs[2], "died", -1, at(D1, 300))
    db.registration("alpha", "apns")
    kept = db.registration("beta", "fcm")
    db.event("beta", "fcm", kept, "created", 1, at(D1, 100))
    db.event("beta", "fcm", 999_999, "created", 1, at(D1, 100))  # the one removed later
    db.event("beta", "fcm", 999_999, "removed", -1, at(D2, 100))
