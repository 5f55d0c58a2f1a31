"""The Spark reports against a real PostgreSQL primary and its streaming replica: known
answers for every figure, incremental runs and re-runs, empty days, a day with one tenant,
anomalies, the outputs (Parquet, primary tables, HTML, CSV) and what they must never hold.

One SparkSession (local[2]) for the module, small data.
"""

from __future__ import annotations

import csv
import math
import os
import random
import re
import subprocess
import sys
from dataclasses import replace
from datetime import date, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from analytics import exports, jobs, reports, sources
from analytics.config import (
    ConfigError,
    Database,
    JobConfig,
    Thresholds,
    Unreachable,
    from_args,
)
from tests.analytics_data import (
    D1,
    D2,
    D3,
    PRIVATE,
    ROOT,
    ReportDatabase,
    at,
    delivered,
    load_known_days,
    not_delivered,
)
from tests.support.ports import free_port
from tests.support.proxy import TcpProxy
from tests.support.spark_cluster import SPARK_HOME, SparkStandalone, spark_env

DAYS = [D1, D2, D3]


@pytest.fixture(scope="module")
def database(tmp_path_factory):
    db = ReportDatabase(tmp_path_factory.mktemp("reports-db"))
    try:
        load_known_days(db)
        db.wait_for_replica()
        yield db
    finally:
        db.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reports-out")


def make_config(
    database: ReportDatabase, workdir: Path, since: date, until: date, **changes
) -> JobConfig:
    config = JobConfig(
        source=Database.from_url(database.replica_url, setting="ANALYTICS_DATABASE_URL"),
        primary=Database.from_url(database.url, setting="DATABASE_URL"),
        output=str(workdir / "parquet"),
        export_dir=workdir / "export",
        since=since,
        until=until,
        master="local[2]",
        driver_memory="1g",
        rows_per_partition=4,  # several JDBC partitions per day even for small days
        min_sends_for_failure_rank=2,
        thresholds=Thresholds(volume_change=1.0, failure_rate_change=0.1, min_volume=50),
    )
    return replace(config, **changes)


@pytest.fixture(scope="module")
def spark(database, workdir):
    session = jobs.session(make_config(database, workdir, D1, D3))
    yield session
    session.stop()


@pytest.fixture(scope="module")
def first_run(spark, database, workdir):
    lines: list[str] = []
    summary = jobs.run(spark, make_config(database, workdir, D1, D3), progress=lines.append)
    return summary, lines


def usage_rows(database, day: date) -> dict[tuple, tuple]:
    rows = database.rows(
        "SELECT level, tenant_name, app_name, provider, publishes_received, pushes_sent, "
        "delivered, dead_tokens, retried, failed, coalesced, rate_limited, refused, unavailable, "
        "success_rate, latency_p50_ms, latency_p95_ms, latency_p99_ms "
        "FROM relay_reportusage WHERE day = %s",
        (day,),
    )
    return {row[:4]: row[4:] for row in rows}


def exact(values: list[float], p: float) -> float:
    """The value of rank ceil(p * n): what the percentiles return within their tolerance."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def within_tolerance(value: float, values: list[float], p: float) -> bool:
    """The documented approximation: an actual latency of the group, at most 1% (1 ms under
    10 ms) below the exact value of rank ceil(p * n), never above it."""
    target = exact(values, p)
    slack = 1.0 if target < 10 else target * sources.RELATIVE_ERROR
    return value in values and target - slack <= value <= target


ALPHA_FCM = [100, 200, 300, 400, 500, 600, 700]
ALPHA_APNS = [50, 60, 70, 80]
BETA_D1 = [1000, 2000, 3000]


def latency(values: list[int]) -> tuple[float, float, float]:
    return tuple(float(exact(values, p)) for p in reports.PERCENTILES)


def test_usage_and_latency_per_level_on_a_day_with_both_tenants(first_run, database):
    summary, _ = first_run
    assert summary.changed == DAYS
    assert summary.rows_read == 19 + 7 + 3  # deliveries of D1 and D2, tally rows
    rows = usage_rows(database, D1)
    # counts: received, sent, delivered, dead, retried, failed, coalesced, limited, refused,
    # unavailable; then success rate and p50/p95/p99
    assert rows[("provider", "alpha", "conv", "fcm")] == (
        15,
        10,
        7,
        1,
        3,
        2,
        3,
        2,
        0,
        0,
        0.7,
        *latency(ALPHA_FCM),
    )
    assert rows[("provider", "alpha", "conv", "")] == (
        4,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        4,
        0,
        None,
        None,
        None,
        None,
    )
    assert rows[("provider", "alpha", "conv", "apns")] == (
        0,
        4,
        4,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        1.0,
        *latency(ALPHA_APNS),
    )
    assert rows[("provider", "beta", "chat", "fcm")] == (
        7,
        5,
        3,
        0,
        0,
        2,
        0,
        0,
        1,
        1,
        0.6,
        *latency(BETA_D1),
    )
    alpha = (19, 14, 11, 1, 3, 2, 3, 2, 4, 0, 11 / 14, *latency(ALPHA_FCM + ALPHA_APNS))
    assert rows[("app", "alpha", "conv", "")] == alpha
    assert rows[("tenant", "alpha", "", "")] == alpha
    everything = ALPHA_FCM + ALPHA_APNS + BETA_D1
    assert rows[("all", "", "", "")] == (
        26,
        19,
        14,
        1,
        3,
        4,
        3,
        2,
        5,
        1,
        14 / 19,
        *latency(everything),
    )
    assert len(rows) == 4 + 2 + 2 + 1
    # The documented approximation holds (here: exact, n is far below the accuracy).
    p50 = rows[("all", "", "", "")][11]
    assert within_tolerance(p50, everything, 0.5)


def test_a_day_with_one_tenant_and_an_empty_day(first_run, database):
    rows = usage_rows(database, D2)
    assert set(rows) == {
        ("provider", "beta", "chat", "fcm"),
        ("app", "beta", "chat", ""),
        ("tenant", "beta", "", ""),
        ("all", "", "", ""),
    }
    assert rows[("tenant", "beta", "", "")] == (0, 3, 3, 0, 0, 0, 0, 0, 0, 0, 1.0, 20.0, 30.0, 30.0)
    assert usage_rows(database, D3) == {}


def test_registrations_live_and_lifecycle(first_run, database):
    rows = database.rows(
        "SELECT day, tenant_name, app_name, provider, active, new, renewed, died, removed "
        "FROM relay_reportregistrations ORDER BY day, tenant_name, provider"
    )
    assert rows == [
        (D1, "alpha", "conv", "apns", 1, 0, 0, 0, 0),
        (D1, "alpha", "conv", "fcm", 2, 3, 1, 1, 0),
        (D1, "beta", "chat", "fcm", 2, 2, 0, 0, 0),
        (D2, "alpha", "conv", "apns", 1, 0, 0, 0, 0),
        (D2, "alpha", "conv", "fcm", 2, 0, 0, 0, 0),
        (D2, "beta", "chat", "fcm", 1, 0, 0, 0, 1),
        (D3, "alpha", "conv", "apns", 1, 0, 0, 0, 0),
        (D3, "alpha", "conv", "fcm", 2, 0, 0, 0, 0),
        (D3, "beta", "chat", "fcm", 1, 0, 0, 0, 0),
    ]


def test_top_domains_and_error_codes(first_run, database):
    domains = database.rows(
        "SELECT tenant_name, publishing_domain, publishes_received, pushes_sent, failed, "
        "failure_rate, rank_by_volume, rank_by_failure_rate FROM relay_reportdomain "
        "WHERE day = %s ORDER BY tenant_name, rank_by_volume",
        (D1,),
    )
    assert domains == [
        ("alpha", "a.example", 15, 9, 0, 0.0, 1, None),
        ("alpha", "x.example", 4, 0, 0, None, 2, None),
        ("alpha", "b.example", 0, 5, 2, 0.4, 3, 1),
        ("beta", "c.example", 7, 5, 2, 0.4, 1, 1),
    ]
    codes = database.rows(
        "SELECT day, tenant_name, provider, outcome, error_code, count FROM relay_reporterrorcode "
        "ORDER BY day, tenant_name, error_code"
    )
    assert codes == [
        (D1, "alpha", "fcm", "failed", "SENDER_ID_MISMATCH", 2),
        (D1, "alpha", "fcm", "dead_token", "UNREGISTERED", 1),
        (D1, "beta", "fcm", "failed", "QUOTA_EXCEEDED", 2),
    ]


def test_parquet_is_partitioned_by_day(first_run, spark, workdir):
    root = workdir / "parquet"
    assert sorted(p.name for p in (root / "usage").iterdir() if p.name.startswith("day=")) == [
        f"day={D1}",
        f"day={D2}",
    ]
    frame = spark.read.parquet(str(root / "usage"))
    assert frame.where(f"day = '{D1}' AND level = 'all'").count() == 1
    assert sorted(
        p.name for p in (root / "registrations").iterdir() if p.name.startswith("day=")
    ) == [f"day={d}" for d in DAYS]


def test_html_report_and_monthly_export(first_run, workdir):
    _, lines = first_run
    page = (workdir / "export" / f"report-{D1}-{D3}.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    # Offline: no address to fetch anything from.
    for external in ("http://", "https://", "src=", "<script", "<link"):
        assert external not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "alpha" in page and "SENDER_ID_MISMATCH" in page
    with (workdir / "export" / "monthly" / "2026-03" / "alpha.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    by_app = {(row["app"], row["provider"]): row for row in rows}
    fcm = by_app[("conv", "fcm")]
    assert (fcm["publishes_received"], fcm["pushes_sent"], fcm["delivered"]) == ("15", "10", "7")
    assert (fcm["registrations_peak"], fcm["registrations_at_month_end"]) == ("2", "2")
    total = by_app[("(all)", "(all)")]
    assert (total["publishes_received"], total["pushes_sent"], total["delivered"]) == (
        "19",
        "14",
        "11",
    )
    assert (total["registrations_peak"], total["days_in_month"]) == ("3", "31")
    # What the file covers: the days the runs covered (D3 had no record), not the whole month.
    for row in rows:
        assert (row["days_reported"], row["status"], row["days_covered"]) == (
            "3",
            "partial",
            f"{D1}..{D3}",
        )
    assert any("3 to compute" in line for line in lines)


def test_every_tenant_gets_its_monthly_file_and_a_month_in_progress_is_partial(
    spark, database, tmp_path
):
    """February 2026 reported whole: complete, 28 days, and a tenant without any activity
    gets its file of zeros. Written on its last day, the same month is partial."""
    database.tenant("idle")
    database.deliveries("beta", "fcm", delivered("c.example", [10, 20], date(2026, 2, 10)))
    database.wait_for_replica()
    first, last = date(2026, 2, 1), date(2026, 2, 28)
    config = make_config(database, tmp_path, first, last, today=date(2026, 3, 1))
    lines: list[str] = []
    summary = jobs.run(spark, config, progress=lines.append)
    folder = tmp_path / "export" / "monthly" / "2026-02"

    def read(tenant: str) -> list[dict[str, str]]:
        with (folder / f"{tenant}.csv").open() as handle:
            return list(csv.DictReader(handle))

    [idle] = read("idle")
    assert (idle["app"], idle["provider"], idle["status"], idle["days_reported"]) == (
        "(all)",
        "(all)",
        "complete",
        "28",
    )
    assert idle["days_covered"] == f"{first}..{last}"
    assert all(idle[column] == "0" for column in ("publishes_received", "pushes_sent", "delivered"))
    beta = read("beta")[-1]
    assert (beta["pushes_sent"], beta["days_reported"], beta["status"]) == (
        "2",
        "28",
        "complete",
    ), (summary, lines)
    assert read("alpha")[-1]["pushes_sent"] == "0"

    # Written on the month's last day (nothing changed, the files are written again): partial.
    jobs.run(spark, replace(config, today=last), progress=lambda _: None)
    assert [row["status"] for row in read("idle") + read("beta")] == ["partial"] * 3


def test_the_days_covered_are_written_as_ranges():
    days = [date(2026, 11, d) for d in (1, 2, 3, 5, 7, 8)]
    assert (
        exports.covered_ranges(days) == "2026-11-01..2026-11-03 2026-11-05 2026-11-07..2026-11-08"
    )
    assert exports.covered_ranges([]) == ""


def test_no_private_value_in_any_output(first_run, database, workdir):
    _, lines = first_run
    blobs = ["\n".join(lines)]
    for path in workdir.rglob("*"):
        if path.is_file():
            blobs.append(path.read_bytes().decode("latin-1"))
    for table in (
        "reportusage",
        "reportregistrations",
        "reportdomain",
        "reporterrorcode",
        "reportanomaly",
    ):
        blobs.append(repr(database.rows(f"SELECT * FROM relay_{table}")))
    text = "\n".join(blobs)
    for private in PRIVATE:
        assert private not in text


def test_an_unchanged_day_is_not_read_again_and_a_changed_one_is_replaced(
    first_run, spark, database, workdir
):
    config = make_config(database, workdir, D1, D3)
    again = jobs.run(spark, config, progress=lambda _: None)
    assert again.changed == [] and again.rows_read == 0 and again.partitions == 0

    # One more push on D2, and a D1 push redelivered (its row updated in place).
    database.deliveries("beta", "fcm", delivered("c.example", [40], D2))
    database.execute(
        "UPDATE relay_delivery SET outcome = 'delivered', error_code = '', "
        "sent = received + interval '5 ms', attempts = 2 WHERE id = ("
        "SELECT min(id) FROM relay_delivery WHERE error_code = 'QUOTA_EXCEEDED')"
    )
    database.wait_for_replica()
    before_d3 = database.rows("SELECT id FROM relay_reportregistrations WHERE day = %s", (D3,))
    lines: list[str] = []
    third = jobs.run(spark, config, progress=lines.append)
    assert third.changed == [D1, D2], (third, lines)
    assert usage_rows(database, D2)[("tenant", "beta", "", "")][:3] == (0, 4, 4)
    beta_d1 = usage_rows(database, D1)[("tenant", "beta", "", "")]
    assert beta_d1[1:6] == (5, 4, 0, 1, 1)  # sent, delivered, dead, retried, failed
    # D3 was not touched: the same rows, not replaced ones.
    assert (
        database.rows("SELECT id FROM relay_reportregistrations WHERE day = %s", (D3,)) == before_d3
    )

    # A forced re-run replaces, never adds: the same figures, one copy.
    snapshot = sorted(usage_rows(database, D1).items())
    forced = jobs.run(spark, replace(config, force=True), progress=lambda _: None)
    assert forced.changed == DAYS
    assert sorted(usage_rows(database, D1).items()) == snapshot
    assert spark.read.parquet(str(workdir / "parquet" / "usage")).where(
        f"day = '{D1}'"
    ).count() == len(snapshot)


def test_a_push_whose_only_change_is_its_send_time_is_recomputed(spark, database, tmp_path):
    """A redelivered push answered later: only `sent` moves, and the day's latency with it."""
    day = date(2026, 6, 1)
    database.deliveries("alpha", "apns", delivered("a.example", [100, 200, 300], day))
    database.wait_for_replica()
    config = make_config(database, tmp_path, day, day)
    assert jobs.run(spark, config, progress=lambda _: None).changed == [day]
    assert usage_rows(database, day)[("provider", "alpha", "conv", "apns")][-3:] == (
        200.0,
        300.0,
        300.0,
    )
    database.execute(
        "UPDATE relay_delivery SET sent = received + interval '900 ms' WHERE id = ("
        "SELECT max(id) FROM relay_delivery WHERE received >= %s AND received < %s)",
        (at(day, 0), at(day + timedelta(days=1), 0)),
    )
    database.wait_for_replica()
    again = jobs.run(spark, config, progress=lambda _: None)
    assert again.changed == [day]
    assert usage_rows(database, day)[("provider", "alpha", "conv", "apns")][-3:] == (
        200.0,
        900.0,
        900.0,
    )


def test_percentiles_of_many_latencies_are_within_the_documented_tolerance(
    spark, database, tmp_path
):
    """3,000 pushes with latencies spread from 1 ms to 20 s: each level's p50/p95/p99 is a
    latency of its group within 1% (1 ms under 10 ms) below the exact one."""
    day = date(2026, 8, 3)
    generator = random.Random(21)
    fcm = [round(generator.lognormvariate(5, 1.5), 3) for _ in range(2000)]
    apns = [round(generator.uniform(1, 20_000), 3) for _ in range(1000)]
    for provider, values in (("fcm", fcm), ("apns", apns)):
        rows = [
            {
                "domain": "a.example",
                "received": at(day, i),
                "latency": ms,
                "outcome": "delivered",
            }
            for i, ms in enumerate(values)
        ]
        database.deliveries("alpha", provider, rows)
    database.wait_for_replica()
    config = make_config(database, tmp_path, day, day, rows_per_partition=500_000)
    jobs.run(spark, config, progress=lambda _: None)
    rows = usage_rows(database, day)
    # Milliseconds as PostgreSQL computes them from the stored timestamps (microseconds).
    stored = {
        provider: [float(ms) for (ms,) in found]
        for provider in ("fcm", "apns")
        if (
            found := database.rows(
                "SELECT date_part('epoch', sent - received) * 1000 FROM relay_delivery "
                "WHERE provider = %s AND received >= %s AND received < %s",
                (provider, at(day, 0), at(day + timedelta(days=1), 0)),
            )
        )
    }
    for key, values in (
        (("provider", "alpha", "conv", "fcm"), stored["fcm"]),
        (("provider", "alpha", "conv", "apns"), stored["apns"]),
        (("tenant", "alpha", "", ""), stored["fcm"] + stored["apns"]),
    ):
        for value, p in zip(rows[key][-3:], reports.PERCENTILES, strict=True):
            assert within_tolerance(value, values, p), (key, p, value, exact(values, p))


def test_unifiedpush_messages_are_a_provider_of_their_own(spark, database, tmp_path):
    """alpha's UnifiedPush messages of one day: in the usage report as provider `up`, per
    component with each outcome, in the error codes, the monthly CSV and the HTML report."""
    day = date(2026, 7, 1)
    latencies = [100, 200, 300, 400]
    database.unifiedpush(
        "alpha",
        [
            {"outcome": "delivered", "received": at(day, 60 * i), "latency": ms, "size": 1000}
            for i, ms in enumerate(latencies)
        ]
        + [{"outcome": "delivered", "received": at(day, 900), "latency": 500, "attempts": 2}]
        + [
            {"outcome": outcome, "received": at(day, 1000 + i), "latency": 9000}
            for i, outcome in enumerate(
                ["expired", "revoked", "replaced", "replaced", "withdrawn", "dropped"]
            )
        ],
    )
    database.wait_for_replica()
    config = make_config(database, tmp_path, day, day)
    summary = jobs.run(spark, config, progress=lambda _: None)
    assert summary.changed == [day] and summary.rows_read == 11

    rows = usage_rows(database, day)
    # received, sent, delivered, dead (revoked), retried, failed (expired, dropped),
    # coalesced (replaced), rate-limited, refused, unavailable; success rate, p50/p95/p99
    up = (11, 11, 5, 1, 1, 2, 2, 0, 0, 0, 5 / 11, *latency([*latencies, 500]))
    assert rows[("provider", "alpha", "", "up")] == up
    assert rows[("tenant", "alpha", "", "")] == up
    [(bytes_relayed,)] = database.rows(
        "SELECT bytes_relayed FROM relay_reportusage WHERE day = %s AND level = 'provider'",
        (day,),
    )
    assert bytes_relayed == 4 * 1000 + 100
    assert database.rows(
        "SELECT tenant_name, component_name, received, delivered, expired, revoked, replaced, "
        "withdrawn, dropped, bytes_relayed FROM relay_reportunifiedpush WHERE day = %s",
        (day,),
    ) == [("alpha", "push.alpha.example", 11, 5, 1, 1, 2, 1, 1, 4100)]
    assert dict(
        database.rows(
            "SELECT error_code, count FROM relay_reporterrorcode "
            "WHERE day = %s AND provider = 'up'",
            (day,),
        )
    ) == {"expired": 1, "revoked": 1, "replaced": 2, "withdrawn": 1, "dropped": 1}
    # No publishing domain: nothing in the domains report.
    assert database.rows("SELECT count(*) FROM relay_reportdomain WHERE day = %s", (day,)) == [(0,)]

    with (tmp_path / "export" / "monthly" / "2026-07" / "alpha.csv").open() as handle:
        lines = {(row["app"], row["provider"]): row for row in csv.DictReader(handle)}
    assert (lines[("", "up")]["pushes_sent"], lines[("", "up")]["bytes_relayed"]) == (
        "11",
        "4100",
    )
    assert lines[("(all)", "(all)")]["delivered"] == "5"
    page = (tmp_path / "export" / f"report-{day}-{day}.html").read_text()
    assert "UnifiedPush per component" in page and "push.alpha.example" in page
    assert "<td>up</td>" in page


def test_web_push_sends_are_a_provider_like_the_others(spark, database, tmp_path):
    """The fourth provider needs nothing of its own in the reports: alpha's Web Push sends of
    one day are in the usage report, the error codes, the monthly CSV and the HTML report."""
    day = date(2026, 9, 15)
    latencies = [40, 50, 60]
    database.deliveries(
        "alpha",
        "webpush",
        delivered("a.example", latencies, day)
        + not_delivered("a.example", "dead_token", "HTTP_410", 2, day)
        + not_delivered("a.example", "failed", "HTTP_413", 1, day),
    )
    database.wait_for_replica()
    summary = jobs.run(spark, make_config(database, tmp_path, day, day), progress=lambda _: None)
    assert summary.changed == [day] and summary.rows_read == 6

    rows = usage_rows(database, day)
    # received (publishes are tallied by the gateway: none here), sent, delivered, dead,
    # retried, failed, coalesced, limited, refused, unavailable; success rate, p50/p95/p99
    webpush = (0, 6, 3, 2, 0, 1, 0, 0, 0, 0, 0.5, *latency(latencies))
    assert rows[("provider", "alpha", "conv", "webpush")] == webpush
    assert rows[("app", "alpha", "conv", "")] == webpush
    assert dict(
        database.rows(
            "SELECT error_code, count FROM relay_reporterrorcode "
            "WHERE day = %s AND provider = 'webpush'",
            (day,),
        )
    ) == {"HTTP_410": 2, "HTTP_413": 1}
    with (tmp_path / "export" / "monthly" / "2026-09" / "alpha.csv").open() as handle:
        lines = {(row["app"], row["provider"]): row for row in csv.DictReader(handle)}
    line = lines[("conv", "webpush")]
    assert (line["pushes_sent"], line["delivered"], line["dead_tokens"]) == ("6", "3", "2")
    page = (tmp_path / "export" / f"report-{day}-{day}.html").read_text()
    assert "<td>webpush</td>" in page and "HTTP_410" in page


def test_the_job_reads_its_settings_through_the_relays_environment(tmp_path):
    """relay.environment declares every ANALYTICS_* variable once; the job reads them typed,
    empty values as unset, and names a bad one."""
    env = {
        "DATABASE_URL": "postgres://relay@primary:5432/relay",
        "ANALYTICS_DATABASE_URL": "postgres://reports@replica:5432/relay",
        "ANALYTICS_ROWS_PER_PARTITION": "",
        "ANALYTICS_SHUFFLE_PARTITIONS": "9",
        "ANALYTICS_MIN_VOLUME": "7",
        "VAR_DIR": str(tmp_path),
    }
    config = from_args(["--since", "2026-01-01", "--until", "2026-01-02"], env)
    assert (config.source.host, config.source.setting) == ("replica", "ANALYTICS_DATABASE_URL")
    assert config.primary is not None and config.primary.host == "primary"
    assert (config.rows_per_partition, config.shuffle_partitions) == (500_000, 9)
    assert config.thresholds.min_volume == 7
    assert config.output == str(tmp_path / "reports")
    with pytest.raises(ConfigError, match="ANALYTICS_MIN_VOLUME"):
        from_args([], {**env, "ANALYTICS_MIN_VOLUME": "many"})


# --- retention: a report outlives its raw records ------------------------------------------------

P0, P1, P2, P3, P4 = (date(2026, 5, 4) + timedelta(days=n) for n in range(5))
REPORT_TABLES = (
    "relay_reportusage",
    "relay_reportregistrations",
    "relay_reportdomain",
    "relay_reporterrorcode",
    "relay_reportanomaly",
)
PARQUET_DATASETS = ("usage", "registrations", "domains", "error_codes", "anomalies")


def later(rows: list[dict], hours: int) -> list[dict]:
    return [{**row, "received": row["received"] + timedelta(hours=hours)} for row in rows]


def stored_reports(spark, db: ReportDatabase, output: Path, days: list[date]) -> dict:
    """Every report row of `days`, in the primary (ids included: a row deleted and inserted
    again is not the same) and in the Parquet outputs."""
    found: dict[str, list] = {
        table: db.rows(f"SELECT * FROM {table} WHERE day = ANY(%s) ORDER BY id", (days,))
        for table in REPORT_TABLES
    }
    for name in PARQUET_DATASETS:
        if any((output / name).rglob("*.parquet")):  # a dataset never written non-empty has none
            frame = spark.read.parquet(str(output / name)).where(days_predicate(days))
            found[name] = sorted((tuple(row) for row in frame.collect()), key=repr)
    return found


def days_predicate(days: list[date]) -> str:
    return "day IN (" + ", ".join(f"DATE '{day}'" for day in days) + ")"


def test_pruned_days_keep_their_reports_and_intact_days_are_still_recomputed(spark, tmp_path):
    """Reports of P1..P4; the retention prunes P0 and P1 whole and P2 up to noon; the next
    runs (forced or not) keep P1's and P2's reports as they were and recompute P3."""
    db = ReportDatabase(tmp_path / "db")
    try:
        db.deliveries("alpha", "fcm", delivered("a.example", [10, 20], P0))
        db.deliveries(
            "alpha",
            "fcm",
            delivered("a.example", [100, 200, 300], P1)
            + not_delivered("b.example", "failed", "QUOTA_EXCEEDED", 1, P1),
        )
        db.tally("alpha", "fcm", "a.example", "accepted", 5, at(P1))
        registration = db.registration("alpha", "fcm")
        db.event("alpha", "fcm", registration, "created", 1, at(P1))
        # P2: three pushes in the morning (pruned), two in the evening (kept)
        db.deliveries(
            "alpha",
            "fcm",
            later(delivered("a.example", [10, 20, 30], P2), 6)
            + later(delivered("a.example", [40, 50], P2), 18),
        )
        db.tally("alpha", "fcm", "a.example", "accepted", 7, at(P2, 6 * 3600))
        db.tally("alpha", "fcm", "a.example", "accepted", 2, at(P2, 18 * 3600))
        db.deliveries("beta", "fcm", delivered("c.example", [5, 6], P3))
        db.deliveries("beta", "fcm", delivered("c.example", [7], P4))
        db.wait_for_replica()
        output = tmp_path / "out"
        config = make_config(db, output, P1, P4)

        first = jobs.run(spark, config, progress=lambda _: None)
        assert first.changed == [P1, P2, P3, P4]
        assert usage_rows(db, P1)[("all", "", "", "")][:3] == (5, 4, 3)
        assert usage_rows(db, P2)[("all", "", "", "")][:3] == (9, 5, 5)
        before = stored_reports(spark, db, output / "parquet", [P1, P2])
        assert all(before[name] for name in ("usage", "registrations", "domains", "error_codes"))

        # The cut falls at P2 12:00 (two days before P4 12:00).
        pruned = db.prune(days=2, now=at(P4, 12 * 3600))
        assert pruned == {
            "relay_delivery": 2 + 4 + 3,
            "relay_registrationevent": 1,
            "relay_publishtally": 2,
            "relay_unifiedpushdelivery": 0,
            "operators_auditentry": 0,
        }
        assert db.rows("SELECT count(*) FROM relay_retentioncut") == [(3,)]
        # P3's records change: it is recomputed, the pruned days are not.
        db.deliveries("beta", "fcm", delivered("c.example", [8], P3, attempts=2))
        db.wait_for_replica()

        lines: list[str] = []
        again = jobs.run(spark, replace(config, since=P0), progress=lines.append)
        assert stored_reports(spark, db, output / "parquet", [P1, P2]) == before
        assert again.kept == [P0, P1, P2] and again.changed == [P3]
        assert usage_rows(db, P3)[("all", "", "", "")][:5] == (0, 3, 3, 0, 1)
        assert any(
            f"3 day(s) through {P2} kept as reported" in line and "1 never reported" in line
            for line in lines
        ), lines
        # P0 was pruned before any report: it stays without one (not an empty one).
        assert stored_reports(spark, db, output / "parquet", [P0]) == {
            **{table: [] for table in REPORT_TABLES},
            **{
                name: []
                for name in PARQUET_DATASETS
                if any((output / "parquet" / name).rglob("*.parquet"))
            },
        }

        forced = jobs.run(spark, replace(config, force=True), progress=lambda _: None)
        assert stored_reports(spark, db, output / "parquet", [P1, P2]) == before
        assert forced.kept == [P1, P2] and forced.changed == [P3, P4]
        # The month's export (what is billed) still counts the pruned days' pushes.
        with (output / "export" / "monthly" / "2026-05" / "alpha.csv").open() as handle:
            total = next(row for row in csv.DictReader(handle) if row["app"] == "(all)")
        assert total["pushes_sent"] == str(4 + 5)
    finally:
        db.close()


def test_anomalies_against_the_previous_seven_days(spark, database, tmp_path):
    """beta: 100 publishes and 100 pushes a day, 1 failed; then a day of 400 and 30 failed."""
    first = date(2026, 4, 1)
    last = first + timedelta(days=7)
    for offset in range(8):
        day = first + timedelta(days=offset)
        burst = day == last
        database.tally("beta", "fcm", "c.example", "accepted", 400 if burst else 100, at(day))
        failed = 30 if burst else 1
        database.deliveries(
            "beta",
            "fcm",
            delivered("c.example", [10] * (100 - failed), day)
            + [
                {
                    "domain": "c.example",
                    "received": at(day, 9000 + i),
                    "latency": 0,
                    "outcome": "failed",
                    "code": "INTERNAL",
                }
                for i in range(failed)
            ],
        )
    database.wait_for_replica()
    config = make_config(database, tmp_path, first, last, rows_per_partition=500_000)
    summary = jobs.run(spark, config, progress=lambda _: None)
    assert summary.changed == [first + timedelta(days=n) for n in range(8)]
    rows = database.rows(
        "SELECT day, scope, tenant_name, app_name, publishing_domain, metric, value, baseline, "
        "threshold, pushes_sent, detail FROM relay_reportanomaly ORDER BY scope, metric"
    )
    # Only the last day has a full 7-day history to compare with; the first seven are quiet.
    assert {row[0] for row in rows} == {last}
    found = {(row[1], row[5]): row for row in rows}
    assert set(found) == {
        (scope, metric)
        for scope in ("app", "domain", "tenant")
        for metric in ("failure_rate", "volume")
    }
    volume = found[("tenant", "volume")]
    assert (volume[2], volume[6], volume[7], volume[8]) == ("beta", 400.0, 100.0, 1.0)
    assert "400 publishes vs 100.0/day" in volume[10]
    rate = found[("domain", "failure_rate")]
    assert rate[4] == "c.example"
    assert rate[6] == pytest.approx(0.30) and rate[7] == pytest.approx(0.01)
    assert rate[9] == 100
    assert found[("app", "volume")][3] == "chat"


# --- the same job on a Spark standalone cluster, and through manage.py --------------------------


def job_env(database: ReportDatabase, workdir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database.url,
        "ANALYTICS_DATABASE_URL": database.replica_url,
        "ANALYTICS_OUTPUT": str(workdir / "parquet"),
        "ANALYTICS_EXPORT_DIR": str(workdir / "export"),
        "ANALYTICS_DRIVER_MEMORY": "1g",
        "PYSPARK_PYTHON": sys.executable,
        "VAR_DIR": str(workdir / "var"),
    }


def test_the_job_runs_unchanged_on_a_standalone_cluster(
    first_run, spark, database, workdir, tmp_path
):
    """spark-submit of analytics/jobs.py to a real master and worker: the same figures."""
    cluster = SparkStandalone().start()
    try:
        result = subprocess.run(
            [
                str(SPARK_HOME / "bin" / "spark-submit"),
                "--master",
                cluster.master_url,
                "--jars",
                "/usr/share/java/postgresql.jar",
                "--driver-memory",
                "1g",
                "--executor-memory",
                "512m",
                "--conf",
                "spark.ui.enabled=false",
                str(ROOT / "analytics" / "jobs.py"),
                "--since",
                str(D1),
                "--until",
                str(D3),
            ],
            cwd=tmp_path,
            env={**spark_env(cluster.workdir), **job_env(database, tmp_path)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        [app] = cluster.completed_apps()
        assert app["name"] == "relay-reports"
    finally:
        cluster.close()
    assert "3 to compute" in result.stdout and "done: 3 day(s)" in result.stdout
    for private in PRIVATE:
        assert private not in result.stdout + result.stderr
    # The cluster's figures are the local run's figures.
    columns = [
        "day",
        "level",
        "tenant_id",
        "app_id",
        "provider",
        "publishes_received",
        "pushes_sent",
        "delivered",
        "failed",
        "latency_p50_ms",
        "latency_p99_ms",
    ]

    def rows(root: Path) -> list:
        frame = spark.read.parquet(str(root / "usage")).where(f"day <= '{D3}'")
        return sorted(tuple(row) for row in frame.select(*columns).collect())

    assert rows(tmp_path / "parquet") == rows(workdir / "parquet")


def test_run_reports_command_shows_progress_and_refuses_a_bad_database(database, tmp_path):
    env = job_env(database, tmp_path)
    command = [sys.executable, "manage.py", "run_reports", "--since", str(D2), "--until", str(D2)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 day(s), 1 to compute" in done.stdout
    assert "loading the daily aggregates" in done.stdout and "done: 1 day(s)" in done.stdout
    assert (tmp_path / "export" / f"report-{D2}-{D2}.html").exists()
    # Quiet: the progress lines and the files written, nothing of Spark's or the JVM's (their
    # stderr is in the job's log file); each step says how long it took.
    lines = done.stdout.splitlines()
    noise = [line for line in lines if not re.match(r"\[reports[ 0-9.s]*\] |wrote ", line)]
    assert noise == [], done.stdout
    for step in ("summed", "usage and latency percentiles", "registrations"):
        assert any(re.search(rf"{step}.* in \d+\.\ds$", line) for line in lines), done.stdout
    assert re.search(r"Spark \S+ on local\[\*\] started in \d+\.\ds", done.stdout)
    assert (tmp_path / "var" / "reports-job.log").exists()

    bad = {**env, "ANALYTICS_DATABASE_URL": "sqlite:///elsewhere.sqlite3"}
    refused = subprocess.run(
        command, cwd=ROOT, env=bad, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0
    assert "ANALYTICS_DATABASE_URL must be a PostgreSQL URL" in refused.stderr


# --- a database the job cannot reach ------------------------------------------------------------


def moved(url: str, port: int, password: str = "") -> str:
    """`url` with another port on the loopback (and a password, if given)."""
    parts = urlsplit(url)
    user = f"{parts.username}:{password}" if password else parts.username
    return parts._replace(netloc=f"{user}@127.0.0.1:{port}").geturl()


def test_run_reports_says_in_one_line_that_the_replica_cannot_be_reached(database, tmp_path):
    port = free_port()  # nothing listens there
    env = {
        **job_env(database, tmp_path),
        "ANALYTICS_DATABASE_URL": moved(database.replica_url, port, "PASSWORD-PRIVATE"),
    }
    command = [sys.executable, "manage.py", "run_reports", "--since", str(D1), "--until", str(D1)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    # One line says it (beside the relay's JSON log lines): where, never the password.
    [line] = [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert line.startswith("CommandError: the reports cannot run: cannot reach")
    assert f"ANALYTICS_DATABASE_URL (127.0.0.1:{port}, database relay)" in line
    assert "refused" in line.lower()
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "PASSWORD-PRIVATE" not in output
    assert "relay-reports" not in output and not (tmp_path / "parquet").exists()  # no Spark


def test_a_connection_failing_inside_spark_is_said_in_one_line(spark, database, tmp_path):
    """Past the check before Spark starts: at Spark's first read of the replica, and inside
    its tasks (the replica goes away once the reads are planned)."""
    port = free_port()
    unreachable = replace(
        make_config(database, tmp_path / "closed", D1, D1),
        source=Database.from_url(
            moved(database.replica_url, port, "PASSWORD-PRIVATE"),
            setting="ANALYTICS_DATABASE_URL",
        ),
    )
    with pytest.raises(Unreachable) as at_first_read:
        jobs.run_reporting_unreachable(spark, unreachable, progress=lambda _: None)
    message = str(at_first_read.value)
    assert "\n" not in message and "PASSWORD-PRIVATE" not in message
    assert message.startswith(f"cannot reach ANALYTICS_DATABASE_URL (127.0.0.1:{port}, ")

    replica = urlsplit(database.replica_url)
    proxy = TcpProxy("127.0.0.1", replica.port or 5432)
    try:
        config = replace(
            make_config(database, tmp_path / "lost", D1, D1),
            source=Database.from_url(
                moved(database.replica_url, proxy.port), setting="ANALYTICS_DATABASE_URL"
            ),
        )

        def progress(line: str) -> None:
            if "JDBC partition(s)" in line:  # planned, not yet read
                proxy.close()

        with pytest.raises(Unreachable) as in_a_task:
            jobs.run_reporting_unreachable(spark, config, progress=progress)
    finally:
        proxy.close()
    message = str(in_a_task.value)
    assert "\n" not in message
    assert message.startswith(f"cannot reach ANALYTICS_DATABASE_URL (127.0.0.1:{proxy.port}, ")
    assert "refused" in message
