"""The Spark reports against PostgreSQL at 1M, 3M and 10M delivery records (30 days), and a
small month (about 22,000 deliveries and 17,500 tally rows).

For each size, in the same run and on the same rows:

- `COPY (SELECT the columns the reports read) TO STDOUT`: the extraction limit;
- PostgreSQL computing the same daily aggregates itself (usage with percentiles at four
  levels, domains, error codes) in SQL;
- the full report on local[2] (every day computed: JDBC read, aggregates, Parquet, primary
  load, HTML and CSV), rows per second;
- the incremental daily run: yesterday already reported, today's rows new (--since
  yesterday --until today), and a no-change run over the whole month (fingerprints only).

Plus the cost of the publish tallies on the gateway's hot path: one upsert per batch.

    python -m tests.support.services -- .venv/bin/python bench/analytics.py
    BENCH_SIZES=1000000 ...   (fewer sizes; 0: the small month only)
    BENCH_MASTER=standalone   (a Spark standalone master and worker on this machine, from
                               tests/support/spark_cluster.py; default local[2]; the
                               worker's BENCH_WORKER_CORES, default 2, and
                               BENCH_WORKER_MEMORY, default 2g)

Each run's progress lines (what was done and how long it took) are kept in the results: the
profile of where a run's time goes.

Prints the figures with the machine's load and writes bench/results/analytics.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analytics import jobs  # noqa: E402
from analytics.config import Database, JobConfig  # noqa: E402
from bench.common import prepare_database, write_results  # noqa: E402

DAYS = 30
FIRST = date(2026, 1, 1)
SETUP = """
import json, django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from relay.models import App, Component, Tenant
ids = []
for n in range(4):
    tenant = Tenant.objects.create(name=f"tenant{n}")
    app = App.objects.create(tenant=tenant, name=f"app{n}")
    component = Component.objects.create(tenant=tenant, app=app, jid=f"push{n}.example",
                                         secret="x")
    ids.append([tenant.pk, app.pk, component.pk])
print(json.dumps(ids))
"""

# Time-ordered like the relay writes them: ids grow with `received`; sequential push ids.
GENERATE = """
INSERT INTO relay_delivery (push_id, tenant_id, app_id, provider, publishing_domain, priority,
    received, queued, sent, attempts, outcome, error_code, coalesced)
SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(i), 12, '0'))::uuid,
       t.tenant_id, t.app_id,
       (ARRAY['fcm', 'apns', 'wns'])[1 + i %% 3],
       'd' || (i %% 200) || '.example', 'high', r.received, r.received,
       CASE WHEN i %% 100 < 90
            THEN r.received + make_interval(secs => (40 + (i * 7919) %% 960) / 1000.0) END,
       1 + (i %% 17 = 0)::int,
       CASE WHEN i %% 100 < 90 THEN 'delivered' WHEN i %% 100 < 94 THEN 'dead_token'
            ELSE 'failed' END,
       CASE WHEN i %% 100 < 90 THEN '' WHEN i %% 100 < 94 THEN 'UNREGISTERED'
            ELSE (ARRAY['QUOTA_EXCEEDED', 'INTERNAL', 'HTTP_500'])[1 + i %% 3] END,
       0
FROM generate_series(%(low)s::bigint, %(high)s::bigint) AS i
CROSS JOIN LATERAL (SELECT %(start)s::timestamptz + make_interval(
    secs => (i - %(low)s) * %(span)s::float8 / (%(high)s - %(low)s + 1)) AS received) r
CROSS JOIN LATERAL (SELECT (%(tenants)s::bigint[])[1 + i %% 4] AS tenant_id,
                           (%(apps)s::bigint[])[1 + i %% 4] AS app_id) t
"""
TALLIES = """
INSERT INTO relay_publishtally (minute, tenant_id, app_id, provider, publishing_domain, verdict,
    count)
SELECT m, t.tenant_id, t.app_id, 'fcm', 'd1.example', v, 1 + (extract(epoch from m)::bigint %% 50)
FROM generate_series(%(start)s::timestamptz, %(end)s::timestamptz - %(step)s::interval,
                     %(step)s::interval) AS m
CROSS JOIN (SELECT unnest(%(tenants)s::bigint[]) AS tenant_id,
                   unnest(%(apps)s::bigint[]) AS app_id) t
CROSS JOIN unnest(%(verdicts)s::text[]) AS v
"""
# The same figures the Spark job computes, by PostgreSQL itself.
SQL_AGGREGATES = [
    """
    SELECT (received AT TIME ZONE 'UTC')::date AS day, tenant_id, app_id, provider,
           count(*), count(*) FILTER (WHERE outcome = 'delivered'),
           count(*) FILTER (WHERE outcome = 'dead_token'), count(*) FILTER (WHERE attempts > 1),
           count(*) FILTER (WHERE outcome = 'failed'),
           percentile_disc(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY
               extract(epoch FROM sent - received) * 1000)
    FROM relay_delivery WHERE received >= %(start)s AND received < %(end)s
    GROUP BY GROUPING SETS ((1, tenant_id, app_id, provider), (1, tenant_id, app_id),
                            (1, tenant_id), (1))
    """,
    """
    SELECT (received AT TIME ZONE 'UTC')::date, tenant_id, lower(publishing_domain), count(*),
           count(*) FILTER (WHERE outcome = 'failed')
    FROM relay_delivery WHERE received >= %(start)s AND received < %(end)s GROUP BY 1, 2, 3
    """,
    """
    SELECT (received AT TIME ZONE 'UTC')::date, tenant_id, app_id, provider, outcome,
           error_code, count(*)
    FROM relay_delivery WHERE received >= %(start)s AND received < %(end)s AND error_code <> ''
    GROUP BY 1, 2, 3, 4, 5, 6
    """,
]
COPY = (
    "COPY (SELECT id, tenant_id, app_id, provider, publishing_domain, received, sent, "
    "attempts, outcome, error_code FROM relay_delivery "
    "WHERE received >= '{start}' AND received < '{end}') TO STDOUT"
)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def at(day: date) -> datetime:
    return datetime.combine(day, datetime.min.time(), tzinfo=UTC)


# Tally rows: hourly, two verdicts per tenant (big sizes); every 30 minutes, three verdicts
# (the small month: 17,280 rows).
BIG_TALLIES = ("1 hour", ["accepted", "rate-limited"])
SMALL_TALLIES = ("30 minutes", ["accepted", "rate-limited", "coalesced"])
SMALL_MONTH_ROWS = 22_000


def generate(
    url: str,
    ids: list,
    low: int,
    high: int,
    first: date,
    days: int,
    tallies: tuple[str, list[str]] = BIG_TALLIES,
) -> float:
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            GENERATE,
            {
                "low": low,
                "high": high,
                "start": at(first),
                "span": days * 86400,
                "tenants": [row[0] for row in ids],
                "apps": [row[1] for row in ids],
            },
        )
        conn.execute(
            TALLIES,
            {
                "start": at(first),
                "end": at(first + timedelta(days=days)),
                "tenants": [row[0] for row in ids],
                "apps": [row[1] for row in ids],
                "step": tallies[0],
                "verdicts": tallies[1],
            },
        )
        conn.execute("VACUUM ANALYZE relay_delivery")
        conn.execute("VACUUM ANALYZE relay_publishtally")
    return time.monotonic() - started


def copy_out(url: str, first: date, last: date) -> tuple[float, int]:
    started = time.monotonic()
    size = 0
    with psycopg.connect(url) as conn, conn.cursor() as cursor:
        query = COPY.format(start=at(first).isoformat(), end=at(last + timedelta(days=1)))
        with cursor.copy(query) as copy:
            for block in copy:
                size += len(block)
    return time.monotonic() - started, size


def sql_aggregates(url: str, first: date, last: date) -> float:
    started = time.monotonic()
    params = {"start": at(first), "end": at(last + timedelta(days=1))}
    with psycopg.connect(url) as conn:
        for sql in SQL_AGGREGATES:
            conn.execute(sql, params).fetchall()
    return time.monotonic() - started


def tally_cost(url: str, *, batch_size: int, batches: int = 400) -> dict:
    """The gateway's extra statement: `tallies.record_verdicts` for a batch of publishes."""
    code = f"""
import json, time, django
django.setup()
from relay.models import Component, Registration
from relay.services import tallies
from relay.services.publishing import Publish, Verdict
component = Component.objects.first()
publishes = [Publish(component_id=component.pk, publishing_domain=f"d{{n % 8}}.example",
                     node=f"n{{n}}", secret="x", important=False) for n in range({batch_size})]
verdicts = [Verdict.ACCEPTED] * {batch_size}
if len(verdicts) >= 8:
    verdicts[-4:] = [Verdict.RATE_LIMITED] * 2 + [Verdict.UNKNOWN_NODE] * 2
times = []
for _ in range({batches}):
    started = time.perf_counter()
    tallies.record_verdicts(publishes, {{}}, verdicts, folded={{1, 2}})
    times.append(time.perf_counter() - started)
times.sort()
print(json.dumps({{"p50_ms": times[len(times) // 2] * 1000,
                  "p99_ms": times[int(len(times) * 0.99)] * 1000}}))
"""
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "pushsite.settings"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    return {
        "batch_size": batch_size,
        "per_batch_p50_ms": round(figures["p50_ms"], 3),
        "per_batch_p99_ms": round(figures["p99_ms"], 3),
        "per_publish_us": round(figures["p50_ms"] * 1000 / batch_size, 2),
    }


def config(url: str, workdir: Path, first: date, last: date, master: str = "local[2]") -> JobConfig:
    db = Database.from_url(url, setting="DATABASE_URL")
    return JobConfig(
        source=db,
        primary=db,
        output=str(workdir / "parquet"),
        export_dir=workdir / "export",
        since=first,
        until=last,
        master=master,
        driver_memory=os.environ.get("ANALYTICS_DRIVER_MEMORY", "3g"),
    )


def bench_size(spark, admin_url: str, rows: int, workdir: Path, *, small: bool = False) -> dict:
    url = prepare_database(admin_url, "bench_analytics")
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "pushsite.settings",
        "VAR_DIR": str(workdir / "var"),
    }
    out = subprocess.run(
        [sys.executable, "-c", SETUP],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    ids = json.loads(out.strip().splitlines()[-1])
    last = FIRST + timedelta(days=DAYS - 1)
    result: dict = {"rows": rows, "days": DAYS, "small_month": small}
    tallies = SMALL_TALLIES if small else BIG_TALLIES
    result["generate_s"] = round(generate(url, ids, 1, rows, FIRST, DAYS, tallies), 2)

    seconds, size = copy_out(url, FIRST, last)
    result["copy_s"] = round(seconds, 2)
    result["copy_rows_per_s"] = round(rows / seconds)
    result["copy_mb"] = round(size / 1e6, 1)
    result["postgres_sql_aggregates_s"] = round(sql_aggregates(url, FIRST, last), 2)

    cfg = config(url, workdir / f"out-{rows}", FIRST, last, MASTER)
    started = time.monotonic()
    profile: list[str] = []
    summary = jobs.run(spark, replace(cfg, force=True), progress=_kept(profile))
    result["spark_full_profile"] = profile
    result["spark_full_s"] = round(time.monotonic() - started, 2)
    result["spark_full_rows_per_s"] = round(summary.rows_read / result["spark_full_s"])
    result["spark_partitions"] = summary.partitions
    result["spark_full_vs_copy"] = round(result["spark_full_s"] / result["copy_s"], 2)

    started = time.monotonic()
    unchanged = jobs.run(spark, cfg, progress=print)
    result["spark_nochange_month_s"] = round(time.monotonic() - started, 2)
    assert unchanged.changed == []

    # The next day arrives; the daily run covers yesterday (unchanged) and today (new).
    per_day = rows // DAYS
    new_day = last + timedelta(days=1)
    generate(url, ids, rows + 1, rows + per_day, new_day, 1, tallies)
    started = time.monotonic()
    profile = []
    daily = jobs.run(spark, replace(cfg, since=last, until=new_day), progress=_kept(profile))
    result["spark_incremental_profile"] = profile
    result["spark_incremental_day_s"] = round(time.monotonic() - started, 2)
    result["spark_incremental_rows"] = daily.rows_read
    assert daily.changed == [new_day]
    result["machine"] = machine()
    if SIZES and rows == min(SIZES):
        result["tally_upsert"] = [tally_cost(url, batch_size=n) for n in (1, 64)]
    return result


def _kept(lines: list[str]):
    def progress(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    return progress


WARM_UP_ROWS = 60_000
SIZES = [
    int(x)
    for x in os.environ.get("BENCH_SIZES", "1000000,3000000,10000000").split(",")
    if int(x) > 0
]
MASTER = os.environ.get("BENCH_MASTER", "local[2]")


def main() -> None:
    admin_url = os.environ.get("DATABASE_URL", "")
    if not admin_url.startswith("postgres"):
        sys.exit("run under `python -m tests.support.services --` (needs PostgreSQL)")
    workdir = Path(tempfile.mkdtemp(prefix="bench-analytics-"))
    cluster = None
    global MASTER
    if MASTER == "standalone":
        from tests.support.spark_cluster import SparkStandalone

        cluster = SparkStandalone(
            cores=int(os.environ.get("BENCH_WORKER_CORES", "2")),
            memory=os.environ.get("BENCH_WORKER_MEMORY", "2g"),
        ).start()
        MASTER = cluster.master_url
    started = time.monotonic()
    spark = jobs.session(config(admin_url, workdir, FIRST, FIRST, MASTER))
    results: dict = {
        "master": MASTER,
        "spark_session_start_s": round(time.monotonic() - started, 2),
        "machine_before": machine(),
        "sizes": [],
    }
    try:
        # Not counted: the first run of a fresh JVM pays for class loading and JIT.
        started = time.monotonic()
        bench_size(spark, admin_url, WARM_UP_ROWS, workdir)
        results["warm_up_s"] = round(time.monotonic() - started, 2)
        small = bench_size(spark, admin_url, SMALL_MONTH_ROWS, workdir, small=True)
        results["small_month"] = small
        print(json.dumps(small), flush=True)
        for rows in SIZES:
            figures = bench_size(spark, admin_url, rows, workdir)
            results["sizes"].append(figures)
            print(json.dumps(figures), flush=True)
    finally:
        spark.stop()
        if cluster is not None:
            cluster.close()
    sizes = results["sizes"]
    if len(sizes) > 1:
        # Linear cost: seconds per million rows should stay flat as the data grows.
        results["spark_full_s_per_million_rows"] = [
            round(s["spark_full_s"] / (s["rows"] / 1e6), 2) for s in sizes
        ]
        results["copy_s_per_million_rows"] = [
            round(s["copy_s"] / (s["rows"] / 1e6), 2) for s in sizes
        ]
    write_results(os.environ.get("BENCH_NAME", "analytics"), results)


if __name__ == "__main__":
    main()
