"""The daily reports job: `python -m analytics.jobs`, or `spark-submit analytics/jobs.py`.

No Django: the same file runs under `manage.py run_reports` (which starts it as a process),
the Celery beat task, and `spark-submit --master spark://...` on a standalone cluster.

One run, for the days --since..--until (UTC):

1. asks the replica for each day's fingerprint (rows, id range and a checksum per source,
   one aggregate statement) and compares it with the fingerprints stored with the outputs:
   a day already reported and unchanged is not read again, and a day the retention pruned
   (all or part of its records) is never recomputed: its stored report stays as it is;
2. reads the changed days' rows over JDBC, a partition per day (big days cut into id
   ranges), filters and column choice pushed down to PostgreSQL;
3. computes usage, latency, registrations, publishing domains and error codes, and replaces
   those days in the Parquet outputs (so a re-run is idempotent);
4. recomputes the anomalies of those days from the Parquet history (7 days back);
5. loads the daily aggregates into the primary (one transaction, the days replaced);
6. writes the HTML report and the monthly CSV exports, then the new fingerprints.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any, cast

if __package__ in (None, ""):
    # Run as a file by spark-submit: import `analytics` from the checkout, and not this
    # folder's modules as top-level ones (they would shadow the standard library's).
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if not p or str(Path(p).resolve()) != _here]
    sys.path.insert(0, str(Path(_here).parent))

from py4j.protocol import Py4JJavaError
from pyspark import StorageLevel
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F

from analytics import exports, report_page, reports, sources, store, writer
from analytics.config import ConfigError, Database, JobConfig, from_args

# Part of every fingerprint: a change to how reports are computed invalidates stored days.
JOB_VERSION = "2"

# Seconds to wait for each database before Spark starts (libpq's minimum is 2).
CONNECT_CHECK_TIMEOUT = 5

Progress = Callable[[str], None]

# Spark's and Hadoop's logging in the driver's JVM: errors only, on stderr.
LOG4J2_PROPERTIES = Path(__file__).resolve().parent / "log4j2.properties"


class Steps:
    """The progress lines: each says what was done and how long it took, after the time
    since the run started."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self.started = self._last = time.monotonic()

    def _line(self, message: str) -> None:
        self._progress(f"[reports {time.monotonic() - self.started:6.1f}s] {message}")

    def say(self, message: str) -> None:
        """What comes next; the following `done` times it."""
        self._line(message)
        self._last = time.monotonic()

    def done(self, message: str) -> None:
        self._line(f"{message} in {time.monotonic() - self._last:.1f}s")
        self._last = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


@dataclass(slots=True)
class RunSummary:
    days: list[date]
    changed: list[date]
    kept: list[date] = field(default_factory=list)  # pruned: the stored report stays
    rows_read: int = 0
    partitions: int = 0
    seconds: float = 0.0
    loaded: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


def session(config: JobConfig) -> SparkSession:
    """A SparkSession for the job: the given master, the one spark-submit set, or local[*]."""
    builder = SparkSession.builder.appName("relay-reports")
    if config.master:
        builder = builder.master(config.master)
    elif "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        builder = builder.master("local[*]")
    spark = (
        builder.config("spark.jars", config.jdbc_jar)
        .config("spark.driver.memory", config.driver_memory)
        # Read when the driver's JVM starts (not under spark-submit, which started it).
        .config(
            "spark.driver.extraJavaOptions",
            f"-Dlog4j2.configurationFile=file:{LOG4J2_PROPERTIES}",
        )
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", str(config.shuffle_partitions))
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # py4j logs every connection it closes at INFO, even while the interpreter shuts down.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    return spark


def fingerprint(day_stats: dict[str, sources.DayStats]) -> str:
    parts = [JOB_VERSION]
    for source in sources.SOURCES:
        stat = day_stats.get(source.name)
        parts.append(
            f"{source.name}:-"
            if stat is None
            else f"{source.name}:{stat.rows}:{stat.min_id}:{stat.max_id}:{stat.checksum}"
        )
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _names_frames(
    spark: SparkSession, tenants: dict[int, str], apps: dict[int, str]
) -> tuple[DataFrame, DataFrame]:
    return (
        F.broadcast(
            spark.createDataFrame(list(tenants.items()), "tenant_id long, tenant_name string")
        ),
        F.broadcast(spark.createDataFrame(list(apps.items()), "app_id long, app_name string")),
    )


def _named(frame: DataFrame, tenant_names: DataFrame, app_names: DataFrame | None) -> DataFrame:
    frame = frame.join(tenant_names, "tenant_id", "left")
    if app_names is not None:
        frame = frame.join(app_names, "app_id", "left")
    filled: dict[str, bool | float | int | str] = {"tenant_name": ""}
    if app_names is not None:
        filled["app_name"] = ""
    return frame.fillna(filled)


def _rows(frame: DataFrame) -> list[dict[str, Any]]:
    return [row.asDict() for row in frame.collect()]


def run(spark: SparkSession, config: JobConfig, progress: Progress = print) -> RunSummary:
    steps = Steps(progress)
    say = steps.say
    days = config.days
    say(f"days {config.since}..{config.until} from {config.source.describe()}")
    with sources.connected(config.source) as conn:
        tenants, apps, components = sources.names(conn)
        stats = sources.day_stats(conn, config.since, config.until)
        pruned_through = sources.pruned_through(conn)
    current = {day: fingerprint(stats.get(day, {})) for day in days}
    stored = store.read_fingerprints(spark, config.output)
    # What is left of a pruned day's records would replace its report (bills are made from
    # it) with a smaller one: such a day keeps its report, --force or not.
    kept = [day for day in days if pruned_through is not None and day <= pruned_through]
    open_days = [day for day in days if day not in kept]
    changed = [day for day in open_days if config.force or stored.get(day) != current[day]]
    summary = RunSummary(days=days, changed=changed, kept=kept)
    unchanged = len(open_days) - len(changed)
    steps.done(
        f"fingerprints compared: {len(days)} day(s), {len(changed)} to compute"
        + (f": {', '.join(str(d) for d in changed)}" if 0 < len(changed) <= 10 else "")
        + (f"; {unchanged} unchanged, not read again" if unchanged else "")
    )
    if kept:
        unreported = [day for day in kept if day not in stored]
        say(
            f"{len(kept)} day(s) through {pruned_through} kept as reported: the retention "
            "pruned their records, so they are never recomputed"
            + (f" ({len(unreported)} never reported: left without a report)" if unreported else "")
        )
    if not changed:
        # The files still say what the runs cover now (a month ended since: complete).
        summary.files = _write_files(spark, config, tenants, set(stored))
        steps.done(f"HTML report and monthly exports: {len(summary.files)} file(s)")
        summary.seconds = steps.elapsed
        say(f"done: nothing changed, in {summary.seconds:.1f}s")
        return summary

    tenant_names, app_names = _names_frames(spark, tenants, apps)
    component_names = F.broadcast(
        spark.createDataFrame(list(components.items()), "component_id long, component_name string")
    )
    _compute_days(
        spark, config, changed, stats, summary, steps, tenant_names, app_names, component_names
    )
    anomaly_rows = _anomalies(spark, config, open_days, set(stored) | set(changed), tenants, apps)
    steps.done(f"anomalies against the previous 7 days: {len(anomaly_rows)} found")

    outputs = _collect_outputs(spark, config, changed)
    if config.primary is not None:
        summary.loaded = writer.load(
            config.primary,
            [
                ("relay_reportusage", changed, outputs["usage"]),
                ("relay_reportregistrations", changed, outputs["registrations"]),
                ("relay_reportdomain", changed, outputs["top_domains"]),
                ("relay_reporterrorcode", changed, outputs["error_codes"]),
                ("relay_reportunifiedpush", changed, outputs["unifiedpush"]),
                ("relay_reportanomaly", open_days, anomaly_rows),
            ],
        )
        steps.done(
            f"loading the daily aggregates into {config.primary.describe()}: "
            f"{sum(summary.loaded.values())} row(s)"
        )
    summary.files = _write_files(spark, config, tenants, set(stored) | set(changed))
    store.write_fingerprints(spark, config.output, {**stored, **{d: current[d] for d in changed}})
    steps.done(f"HTML report and monthly exports: {len(summary.files)} file(s)")
    summary.seconds = steps.elapsed
    rate = summary.rows_read / summary.seconds if summary.seconds else 0.0
    say(
        f"done: {len(changed)} day(s), {summary.rows_read} row(s) in {summary.seconds:.1f}s "
        f"({rate:,.0f} rows/s)"
    )
    return summary


def _compute_days(
    spark: SparkSession,
    config: JobConfig,
    changed: list[date],
    stats: dict[date, dict[str, sources.DayStats]],
    summary: RunSummary,
    steps: Steps,
    tenant_names: DataFrame,
    app_names: DataFrame,
    component_names: DataFrame,
) -> None:
    """Read the changed days and replace them in every Parquet dataset but the anomalies."""
    expected = sum(
        stats.get(day, {}).get(source.name, sources.DayStats(0, 0, 0, 0)).rows
        for day in changed
        for source in sources.SOURCES
        if source.sums
    )
    partial_sums, histogram, partitions = sources.read_sums(
        spark, config.source, changed, stats, rows_per_partition=config.rows_per_partition
    )
    summary.partitions = partitions
    steps.say(f"summing {expected} row(s) in PostgreSQL, {partitions} JDBC partition(s)")
    # PostgreSQL sums each partition by the finest key every report needs and buckets its
    # latencies; Spark merges the partitions' sums (small) and keeps them for every report.
    sums = reports.summed(partial_sums).persist(StorageLevel.MEMORY_AND_DISK)
    summary.rows_read = int(cast(Row, sums.agg(F.sum("rows")).first())[0] or 0)
    buckets = _rows(
        histogram.groupBy("day", "tenant_id", "app_id", "provider", "bucket").agg(
            F.sum("n").alias("n"), F.min("low").alias("low")
        )
    )
    steps.done(f"summed {summary.rows_read} row(s), {len(buckets)} latency bucket(s)")
    latencies = spark.createDataFrame(reports.percentile_rows(buckets), reports.LATENCY_SCHEMA)
    usage = _named(reports.usage(sums, latencies), tenant_names, app_names)
    store.replace_days(spark, config.output, "usage", usage, changed)
    steps.done("usage and latency percentiles")
    store.replace_days(
        spark,
        config.output,
        "domains",
        _named(reports.domains(sums), tenant_names, None),
        changed,
    )
    store.replace_days(
        spark,
        config.output,
        "error_codes",
        _named(reports.error_codes(sums), tenant_names, app_names),
        changed,
    )
    store.replace_days(
        spark,
        config.output,
        "unifiedpush",
        _named(reports.unifiedpush(sums), tenant_names, None)
        .join(component_names, "component_id", "left")
        .fillna({"component_name": ""}),
        changed,
    )
    sums.unpersist()
    steps.done("publishing domains, error codes and UnifiedPush")

    registration_rows = reports.registrations(
        _registration_rows(config, min(changed)),
        changed,
    )
    registrations = spark.createDataFrame(registration_rows, reports.REGISTRATION_SCHEMA)
    store.replace_days(
        spark,
        config.output,
        "registrations",
        _named(registrations, tenant_names, app_names),
        changed,
    )
    steps.done("registrations")


def _registration_rows(config: JobConfig, first: date) -> list[dict[str, Any]]:
    with sources.connected(config.source) as conn:
        return sources.query(conn, sources.registration_sql(first))


def _anomalies(
    spark: SparkSession,
    config: JobConfig,
    days: list[date],
    reported: set[date],
    tenants: dict[int, str],
    apps: dict[int, str],
) -> list[dict[str, Any]]:
    """The anomalies of `days` from the Parquet history (7 days back), replaced in Parquet."""
    first = config.since - timedelta(days=7)
    usage_history = store.read_days(
        spark, config.output, "usage", first, config.until, reports.USAGE_SCHEMA
    )
    domain_history = store.read_days(
        spark,
        config.output,
        "domains",
        first,
        config.until,
        "day date, tenant_id long, publishing_domain string, publishes_received long, "
        "pushes_sent long, failed long, failure_rate double",
    )
    # Only days whose seven previous days are all reported have a baseline to compare with.
    comparable = [
        day for day in days if all(day - timedelta(days=k) in reported for k in range(1, 8))
    ]
    anomaly_rows = reports.anomalies(
        reports.baselines(usage_history, domain_history, comparable), config.thresholds
    )
    for row in anomaly_rows:
        row["tenant_name"] = tenants.get(row["tenant_id"], "")
        row["app_name"] = apps.get(row["app_id"], "") if row["app_id"] is not None else ""
        row["detail"] = reports.describe_anomaly(row)
    store.replace_days(
        spark,
        config.output,
        "anomalies",
        spark.createDataFrame(anomaly_rows, NAMED_ANOMALIES),
        days,
    )
    return anomaly_rows


def _read(
    spark: SparkSession, config: JobConfig, name: str, first: date, last: date, schema: str
) -> DataFrame:
    return store.read_days(spark, config.output, name, first, last, schema)


def _collect_outputs(
    spark: SparkSession, config: JobConfig, days: list[date]
) -> dict[str, list[dict[str, Any]]]:
    """The changed days' rows as the primary stores them (top domains only)."""
    first, last = min(days), max(days)
    wanted = F.col("day").isin(days)
    domains = _read(spark, config, "domains", first, last, DOMAIN_SCHEMA).where(wanted)
    return {
        "usage": _rows(_read(spark, config, "usage", first, last, NAMED_USAGE).where(wanted)),
        "registrations": _rows(
            _read(spark, config, "registrations", first, last, NAMED_REGISTRATIONS).where(wanted)
        ),
        "top_domains": _rows(
            reports.top_domains(
                domains, top=config.top_domains, min_sends=config.min_sends_for_failure_rank
            )
        ),
        "error_codes": _rows(
            _read(spark, config, "error_codes", first, last, ERROR_SCHEMA).where(wanted)
        ),
        "unifiedpush": _rows(
            _read(spark, config, "unifiedpush", first, last, NAMED_UNIFIEDPUSH).where(wanted)
        ),
    }


NAMED_USAGE = reports.USAGE_SCHEMA + ", tenant_name string, app_name string"
NAMED_UNIFIEDPUSH = reports.UNIFIEDPUSH_SCHEMA + ", tenant_name string, component_name string"
NAMED_REGISTRATIONS = reports.REGISTRATION_SCHEMA + ", tenant_name string, app_name string"
NAMED_ANOMALIES = reports.ANOMALY_SCHEMA + ", tenant_name string, app_name string, detail string"
DOMAIN_SCHEMA = (
    "day date, tenant_id long, publishing_domain string, publishes_received long, "
    "pushes_sent long, failed long, failure_rate double, tenant_name string"
)
ERROR_SCHEMA = (
    "day date, tenant_id long, app_id long, provider string, outcome string, "
    "error_code string, count long, tenant_name string, app_name string"
)


def _write_files(
    spark: SparkSession, config: JobConfig, tenants: dict[int, str], reported: set[date]
) -> list[str]:
    """The HTML report of the range and the CSV exports of every month it touches: one per
    tenant (zeros for one without activity), saying which days the runs covered (`reported`)."""
    config.export_dir.mkdir(parents=True, exist_ok=True)
    months = exports.months_of(config.days)
    first = min(config.since, months[0])
    last = max(config.until, exports.month_bounds(months[-1])[1])
    usage = _rows(_read(spark, config, "usage", first, last, NAMED_USAGE))
    registrations = _rows(_read(spark, config, "registrations", first, last, NAMED_REGISTRATIONS))
    in_range = lambda row: config.since <= row["day"] <= config.until  # noqa: E731
    domains = _read(spark, config, "domains", config.since, config.until, DOMAIN_SCHEMA)
    page = report_page.render(
        since=config.since,
        until=config.until,
        days=config.days,
        usage_rows=[row for row in usage if in_range(row)],
        registration_rows=[row for row in registrations if in_range(row)],
        domain_rows=_rows(
            reports.top_domains(
                domains, top=config.top_domains, min_sends=config.min_sends_for_failure_rank
            )
        ),
        error_rows=_rows(
            _read(spark, config, "error_codes", config.since, config.until, ERROR_SCHEMA)
        ),
        unifiedpush_rows=_rows(
            _read(spark, config, "unifiedpush", config.since, config.until, NAMED_UNIFIEDPUSH)
        ),
        # The whole range's, kept days' included (they are not recomputed).
        anomaly_rows=_rows(
            _read(spark, config, "anomalies", config.since, config.until, NAMED_ANOMALIES).orderBy(
                "day", "scope", "tenant_name", "app_name", "publishing_domain", "metric"
            )
        ),
    )
    report = config.export_dir / f"report-{config.since}-{config.until}.html"
    report.write_text(page, encoding="utf-8")
    files = [str(report)]
    for month in months:
        files += [
            str(path)
            for path in exports.write_month(
                config.export_dir,
                month,
                usage,
                registrations,
                tenants=tenants.values(),
                reported=reported,
                today=config.today,
            )
        ]
    return files


def connection_failure(error: BaseException) -> str | None:
    """Why Spark's JDBC connection failed, when that is what `error` is; else None.

    At analysis (the first read of a table) Spark says FAILED_JDBC.CONNECTION; inside a
    task, the driver's PSQLException arrives in the Java causes, with an SQL state of class
    08 (connection exception) when connecting failed or the connection was lost."""
    if isinstance(error, PySparkException):
        condition = error.getCondition() or ""
        return "JDBC connection failed" if condition.startswith("FAILED_JDBC.CONNECTION") else None
    if isinstance(error, Py4JJavaError):
        cause = error.java_exception
        for _ in range(20):  # a cause chain is short; never follow a cycle
            if cause is None:
                break
            if cause.getClass().getName() == "org.postgresql.util.PSQLException":
                if not str(cause.getSQLState() or "").startswith("08"):
                    return None
                return str(cause.getMessage()).split(". ")[0]
            cause = cause.getCause()
    return None


def run_reporting_unreachable(
    spark: SparkSession, config: JobConfig, progress: Progress = print
) -> RunSummary:
    """`run`, with a JDBC connection failing inside Spark raised as the one-line Unreachable
    (Spark reads the replica only; the primary is loaded over libpq, which says so itself)."""
    try:
        return run(spark, config, progress)
    except (PySparkException, Py4JJavaError) as error:
        reason = connection_failure(error)
        if reason is None:
            raise
        raise config.source.unreachable(reason) from None


def databases(config: JobConfig) -> list[Database]:
    """The databases a run connects to: the replica, and the primary unless it is the same."""
    if config.primary is None or config.primary == config.source:
        return [config.source]
    return [config.source, config.primary]


def main(argv: list[str] | None = None) -> int:
    try:
        config = from_args(argv)
        # Before Spark (seconds to start, and its own longer timeouts): a database that
        # cannot be reached is said in one line, at once.
        for db in databases(config):
            db.connect(timeout=CONNECT_CHECK_TIMEOUT).close()
        started = time.monotonic()
        spark = session(config)
        print(
            f"[reports] Spark {spark.version} on {spark.sparkContext.master} started in "
            f"{time.monotonic() - started:.1f}s",
            flush=True,
        )
        try:
            summary = run_reporting_unreachable(
                spark, config, progress=lambda line: print(line, flush=True)
            )
        finally:
            spark.stop()
    except ConfigError as error:  # a setting, or a database it cannot reach: one line
        print(f"analytics.jobs: {error}", file=sys.stderr, flush=True)
        return 2
    for path in summary.files:
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
