"""The relay's tables as the reports read them: fingerprints per day, partitioned JDBC reads,
and one common shape ("facts") that every source of pushes maps its rows to.

Adding a source (e.g. the UnifiedPush deliveries) is one more `Source` in `SOURCES`: its
table, its time column, a cheap checksum for the fingerprint, and a mapping of its rows onto
`FACT_COLUMNS`. Nothing else changes: fingerprints, reads and every report pick it up.

Only table and column names of the relay are known here; nothing of its code is imported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from analytics.config import Database
from analytics.schema import COUNT_COLUMNS, UNIFIEDPUSH

# Every source of pushes becomes rows of this shape; counts are per row (a tally row carries
# many publishes), latency only where a provider answered a delivered push.
FACT_COLUMNS = (
    "day",
    "tenant_id",
    "app_id",
    "component_id",
    "provider",
    "publishing_domain",
    *COUNT_COLUMNS,
    "latency_ms",
    "outcome",
    "error_code",
)


@dataclass(frozen=True, slots=True)
class Source:
    name: str
    table: str
    time_column: str
    # SQL aggregate over the day's rows that changes when a row is updated in place.
    checksum: str
    # Columns to read (pushed down: Spark selects only these).
    columns: tuple[str, ...]
    # Rows -> FACT_COLUMNS; None for a source that is not pushes (the lifecycle log).
    facts: Callable[[DataFrame], DataFrame] | None
    # Slice big days into id ranges of about `rows_per_partition` rows each.
    split_days: bool = False
    # What the reads select from, when not the table itself: a view computed by PostgreSQL
    # (the UTC day, a latency) so Spark decodes one small value instead of timestamps.
    read_from: str = ""
    # Rows that have a latency (SQL, pushed down), their columns, and -> LATENCY_COLUMNS.
    latency_where: str = ""
    latency_columns: tuple[str, ...] = ()
    latencies: Callable[[DataFrame], DataFrame] | None = None


def _count(condition: Column) -> Column:
    return F.when(condition, F.lit(1)).otherwise(F.lit(0)).cast("long")


def _delivery_facts(rows: DataFrame) -> DataFrame:
    delivered = F.col("outcome") == "delivered"
    return rows.select(
        F.col("day"),
        F.col("tenant_id").cast("long"),
        F.col("app_id").cast("long"),
        F.lit(None).cast("long").alias("component_id"),
        F.col("provider"),
        F.lower(F.col("publishing_domain")).alias("publishing_domain"),
        F.lit(0).cast("long").alias("publishes_received"),
        F.lit(1).cast("long").alias("pushes_sent"),
        _count(delivered).alias("delivered"),
        _count(F.col("outcome") == "dead_token").alias("dead_tokens"),
        _count(F.col("attempts") > 1).alias("retried"),
        _count(F.col("outcome") == "failed").alias("failed"),
        F.lit(0).cast("long").alias("coalesced"),
        F.lit(0).cast("long").alias("rate_limited"),
        F.lit(0).cast("long").alias("refused"),
        F.lit(0).cast("long").alias("unavailable"),
        F.lit(0).cast("long").alias("bytes_relayed"),
        # Latencies have a narrow read of their own (`read_latencies`).
        F.lit(None).cast("double").alias("latency_ms"),
        F.col("outcome"),
        F.col("error_code"),
    )


LATENCY_COLUMNS = ("day", "tenant_id", "app_id", "provider", "latency_ms")


def _delivery_latencies(rows: DataFrame) -> DataFrame:
    return rows.select(
        F.col("day"),
        F.col("tenant_id").cast("long"),
        F.col("app_id").cast("long"),
        F.col("provider"),
        F.col("latency_ms"),
    )


def _tally_facts(rows: DataFrame) -> DataFrame:
    count = F.col("count").cast("long")

    def when(*verdicts: str) -> Column:
        return F.when(F.col("verdict").isin(*verdicts), count).otherwise(F.lit(0).cast("long"))

    return rows.select(
        F.to_date("minute").alias("day"),
        F.col("tenant_id").cast("long"),
        F.col("app_id").cast("long"),
        F.lit(None).cast("long").alias("component_id"),
        F.col("provider"),
        F.col("publishing_domain"),
        count.alias("publishes_received"),
        F.lit(0).cast("long").alias("pushes_sent"),
        F.lit(0).cast("long").alias("delivered"),
        F.lit(0).cast("long").alias("dead_tokens"),
        F.lit(0).cast("long").alias("retried"),
        F.lit(0).cast("long").alias("failed"),
        when("coalesced").alias("coalesced"),
        when("rate-limited").alias("rate_limited"),
        when("unknown-node", "forbidden").alias("refused"),
        when("unavailable").alias("unavailable"),
        F.lit(0).cast("long").alias("bytes_relayed"),
        F.lit(None).cast("double").alias("latency_ms"),
        F.lit("").alias("outcome"),
        F.lit("").alias("error_code"),
    )


DELIVERIES = Source(
    name="deliveries",
    table="relay_delivery",
    time_column="received",
    # A redelivered or replayed push updates its row in place (same id, same count): its
    # outcome, attempts, error code or send time (the latency) change. Integer sums only (a
    # hash of each row's text cost more than the rest of the scan); the send time as
    # microseconds after the publish, summed exactly (numeric) and folded below 2^31.
    checksum="sum(attempts) + 1009 * count(sent) "
    "+ 7919 * count(*) FILTER (WHERE outcome = 'delivered') "
    "+ 104729 * count(*) FILTER (WHERE outcome = 'failed') + 3 * sum(length(error_code)) "
    "+ 31 * mod(coalesce(sum(CAST(date_part('epoch', sent - received) * 1000000 AS bigint)), 0), "
    "2147483647)",
    read_from="(SELECT d.*, CAST((received AT TIME ZONE 'UTC') AS date) AS day, "
    "date_part('epoch', sent - received) * 1000 AS latency_ms FROM relay_delivery d) AS d",
    columns=(
        "tenant_id",
        "app_id",
        "provider",
        "publishing_domain",
        "day",
        "attempts",
        "outcome",
        "error_code",
    ),
    facts=_delivery_facts,
    split_days=True,
    latency_where="outcome = 'delivered' AND sent IS NOT NULL",
    latency_columns=("day", "tenant_id", "app_id", "provider", "latency_ms"),
    latencies=_delivery_latencies,
)
TALLIES = Source(
    name="tallies",
    table="relay_publishtally",
    time_column="minute",
    checksum="sum(count)",  # upserts add to a row's count
    columns=(
        "tenant_id",
        "app_id",
        "provider",
        "publishing_domain",
        "verdict",
        "count",
        "minute",
    ),
    facts=_tally_facts,
)


def _unifiedpush_facts(rows: DataFrame) -> DataFrame:
    """A UnifiedPush message (a POST, or a Matrix gateway notification for one device) as a
    push of provider `up`: received and finished once; delivered when the phone answered;
    the other outcomes as the push counters closest to them (revoked: the phone's endpoint is
    gone, a dead token; expired and dropped: lost, failed; replaced by a newer message with
    its Topic: coalesced) and each by name as its `error_code`. No app: the component says
    where it went; no publishing domain."""
    outcome = F.col("outcome")
    return rows.select(
        F.col("day"),
        F.col("tenant_id").cast("long"),
        F.lit(None).cast("long").alias("app_id"),
        F.col("component_id").cast("long"),
        F.lit(UNIFIEDPUSH).alias("provider"),
        F.lit(None).cast("string").alias("publishing_domain"),
        F.lit(1).cast("long").alias("publishes_received"),
        F.lit(1).cast("long").alias("pushes_sent"),
        _count(outcome == "delivered").alias("delivered"),
        _count(outcome == "revoked").alias("dead_tokens"),
        _count(F.col("attempts") > 1).alias("retried"),
        _count(outcome.isin("expired", "dropped")).alias("failed"),
        _count(outcome == "replaced").alias("coalesced"),
        F.lit(0).cast("long").alias("rate_limited"),
        F.lit(0).cast("long").alias("refused"),
        F.lit(0).cast("long").alias("unavailable"),
        F.when(outcome == "delivered", F.col("size").cast("long"))
        .otherwise(F.lit(0).cast("long"))
        .alias("bytes_relayed"),
        F.lit(None).cast("double").alias("latency_ms"),
        outcome,
        F.when(outcome == "delivered", F.lit("")).otherwise(outcome).alias("error_code"),
    )


def _unifiedpush_latencies(rows: DataFrame) -> DataFrame:
    return rows.select(
        F.col("day"),
        F.col("tenant_id").cast("long"),
        F.lit(None).cast("long").alias("app_id"),
        F.lit(UNIFIEDPUSH).alias("provider"),
        F.col("latency_ms"),
    )


# Written by the UnifiedPush app (relay.unifiedpush): one row per message once it ended,
# never updated.
UNIFIEDPUSH_DELIVERIES = Source(
    name="unifiedpush",
    table="relay_unifiedpushdelivery",
    time_column="received",
    checksum="sum(size) + 7 * sum(attempts)",
    read_from="(SELECT u.*, CAST((received AT TIME ZONE 'UTC') AS date) AS day, "
    "date_part('epoch', finished - received) * 1000 AS latency_ms "
    "FROM relay_unifiedpushdelivery u) AS u",
    columns=("tenant_id", "component_id", "day", "outcome", "size", "attempts"),
    facts=_unifiedpush_facts,
    split_days=True,
    latency_where="outcome = 'delivered'",
    latency_columns=("day", "tenant_id", "latency_ms"),
    latencies=_unifiedpush_latencies,
)
EVENTS = Source(
    name="events",
    table="relay_registrationevent",
    time_column="at",
    checksum="sum(live_change)",
    columns=(),
    facts=None,
)
SOURCES: tuple[Source, ...] = (DELIVERIES, TALLIES, UNIFIEDPUSH_DELIVERIES, EVENTS)


def day_start(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def _literal(moment: datetime) -> str:
    return f"TIMESTAMPTZ '{moment.isoformat()}'"


def _day_range(source: Source, first: date, last: date) -> str:
    column = source.time_column
    start, end = day_start(first), day_start(last + timedelta(days=1))
    return f"{column} >= {_literal(start)} AND {column} < {_literal(end)}"


def jdbc_query(spark: SparkSession, db: Database, sql: str) -> DataFrame:
    """One query run by PostgreSQL (aggregates pushed down whole); its result is small."""
    return spark.read.jdbc(db.jdbc_url, f"({sql}) AS q", properties=db.jdbc_properties)


@dataclass(frozen=True, slots=True)
class DayStats:
    """What PostgreSQL says of one source's rows on one day: enough to tell a changed day
    and to split its read into id ranges."""

    rows: int
    min_id: int
    max_id: int
    checksum: int


def fingerprint_sql(first: date, last: date, sources: Iterable[Source] = SOURCES) -> str:
    parts = [
        f"SELECT '{source.name}' AS source, "
        f"CAST(({source.time_column} AT TIME ZONE 'UTC') AS date) AS day, "
        "count(*) AS n, min(id) AS min_id, max(id) AS max_id, "
        f"CAST(coalesce({source.checksum}, 0) AS bigint) AS checksum "
        f"FROM {source.table} WHERE {_day_range(source, first, last)} GROUP BY 2"
        for source in sources
    ]
    return " UNION ALL ".join(parts)


def day_stats(
    spark: SparkSession, db: Database, first: date, last: date
) -> dict[date, dict[str, DayStats]]:
    """Per day and source, in one statement on the replica (one snapshot): index range scans
    and an aggregate, no rows leave PostgreSQL."""
    stats: dict[date, dict[str, DayStats]] = {}
    for row in jdbc_query(spark, db, fingerprint_sql(first, last)).collect():
        stats.setdefault(row["day"], {})[row["source"]] = DayStats(
            int(row["n"]), int(row["min_id"]), int(row["max_id"]), int(row["checksum"])
        )
    return stats


# Written by the relay's retention (relay.report_models.RetentionCut) before it deletes rows.
RETENTION_CUTS = "relay_retentioncut"


def pruned_through_sql(sources: Iterable[Source] = SOURCES) -> str:
    """The last day each source's retention reached into: the day of the instant before the
    cut (a cut at midnight leaves that day whole)."""
    tables = ", ".join(f"'{source.table}'" for source in sources)
    return (
        "SELECT table_name, CAST(((pruned_before - interval '1 microsecond') "
        "AT TIME ZONE 'UTC') AS date) AS last_day "
        f"FROM {RETENTION_CUTS} WHERE table_name IN ({tables})"
    )


def pruned_through(spark: SparkSession, db: Database) -> date | None:
    """The last day some of whose records the retention deleted (None: nothing pruned).

    Read after `day_stats`: the relay commits a cut before it deletes the rows, so every row
    missing from those fingerprints is covered by a cut this read sees."""
    days = [row["last_day"] for row in jdbc_query(spark, db, pruned_through_sql()).collect()]
    return max(days, default=None)


def predicates(
    source: Source, days: Iterable[date], stats: dict[date, dict[str, DayStats]], per: int
) -> list[str]:
    """One WHERE clause per JDBC partition: a day each, and a big day of a splittable source
    cut into id ranges of about `per` rows (ids grow with time, so a range is contiguous)."""
    clauses: list[str] = []
    for day in days:
        day_stat = stats.get(day, {}).get(source.name)
        if day_stat is None:
            continue  # nothing on that day: no query at all
        where = _day_range(source, day, day)
        slices = math.ceil(day_stat.rows / per) if source.split_days else 1
        if slices <= 1:
            clauses.append(where)
            continue
        span = day_stat.max_id - day_stat.min_id + 1
        step = math.ceil(span / slices)
        for low in range(day_stat.min_id, day_stat.max_id + 1, step):
            clauses.append(f"{where} AND id >= {low} AND id < {low + step}")
    return clauses


def _jdbc(
    spark: SparkSession, db: Database, source: Source, clauses: list[str], fetch_size: int
) -> DataFrame:
    """A source's rows, one JDBC partition (one query) per WHERE clause; the columns the
    caller selects are the only ones PostgreSQL sends."""
    return spark.read.jdbc(
        db.jdbc_url,
        source.read_from or source.table,
        predicates=clauses,
        properties={**db.jdbc_properties, "fetchsize": str(fetch_size)},
    )


def read_facts(
    spark: SparkSession,
    db: Database,
    days: list[date],
    stats: dict[date, dict[str, DayStats]],
    *,
    rows_per_partition: int,
    fetch_size: int = 10_000,
) -> tuple[DataFrame, int]:
    """Every push source's rows of `days` as facts, and how many JDBC partitions read them."""
    frames: list[DataFrame] = []
    partitions = 0
    for source in SOURCES:
        if source.facts is None:
            continue
        clauses = predicates(source, days, stats, rows_per_partition)
        if not clauses:
            continue
        partitions += len(clauses)
        rows = _jdbc(spark, db, source, clauses, fetch_size).select(*source.columns)
        frames.append(source.facts(rows).select(*FACT_COLUMNS))
    if not frames:
        return empty_facts(spark), 0
    facts = frames[0]
    for frame in frames[1:]:
        facts = facts.unionByName(frame)
    return facts, partitions


def read_latencies(
    spark: SparkSession,
    db: Database,
    days: list[date],
    stats: dict[date, dict[str, DayStats]],
    *,
    rows_per_partition: int,
    fetch_size: int = 10_000,
) -> DataFrame:
    """The latency of every delivered push of `days`: a narrow read of its own (five columns,
    delivered rows only, both pushed down), for the percentiles."""
    frames: list[DataFrame] = []
    for source in SOURCES:
        if source.latencies is None:
            continue
        clauses = [
            f"{clause} AND {source.latency_where}"
            for clause in predicates(source, days, stats, rows_per_partition)
        ]
        if not clauses:
            continue
        rows = _jdbc(spark, db, source, clauses, fetch_size).select(*source.latency_columns)
        frames.append(source.latencies(rows).select(*LATENCY_COLUMNS))
    if not frames:
        return spark.createDataFrame(
            [], "day date, tenant_id long, app_id long, provider string, latency_ms double"
        )
    latencies = frames[0]
    for frame in frames[1:]:
        latencies = latencies.unionByName(frame)
    return latencies


FACT_SCHEMA = (
    "day date, tenant_id long, app_id long, component_id long, provider string, "
    "publishing_domain string, publishes_received long, pushes_sent long, delivered long, "
    "dead_tokens long, retried long, failed long, coalesced long, rate_limited long, "
    "refused long, unavailable long, bytes_relayed long, latency_ms double, outcome string, "
    "error_code string"
)


def empty_facts(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame([], FACT_SCHEMA)


def registration_sql(first: date) -> str:
    """Today's live registrations per tenant, app and provider, and the lifecycle events
    since `first` per day and kind, in ONE statement (one snapshot, so they agree)."""
    return (
        "SELECT 'live' AS part, a.tenant_id, r.app_id, r.service AS provider, "
        "CAST(NULL AS date) AS day, '' AS kind, count(*) AS n, CAST(0 AS bigint) AS change "
        "FROM relay_registration r JOIN relay_app a ON a.id = r.app_id "
        "WHERE r.dead_since IS NULL GROUP BY a.tenant_id, r.app_id, r.service "
        "UNION ALL "
        "SELECT 'event', tenant_id, app_id, provider, "
        "CAST((at AT TIME ZONE 'UTC') AS date), kind, count(*), "
        "CAST(sum(live_change) AS bigint) "
        f"FROM relay_registrationevent WHERE at >= {_literal(day_start(first))} "
        "GROUP BY tenant_id, app_id, provider, 5, kind"
    )


def names(
    spark: SparkSession, db: Database
) -> tuple[dict[int, str], dict[int, str], dict[int, str]]:
    """Tenant and app names and component JIDs (a server's, never a user's) by id (small
    tables): the reports name what they count."""
    found: dict[str, dict[int, str]] = {"tenant": {}, "app": {}, "component": {}}
    for row in jdbc_query(
        spark,
        db,
        "SELECT 'tenant' AS kind, id, name FROM relay_tenant UNION ALL "
        "SELECT 'app', id, name FROM relay_app UNION ALL "
        "SELECT 'component', id, jid FROM relay_component",
    ).collect():
        found[row["kind"]][int(row["id"])] = row["name"]
    return found["tenant"], found["app"], found["component"]
