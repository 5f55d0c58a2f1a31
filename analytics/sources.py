"""The relay's tables as the reports read them: fingerprints per day, and each source of
pushes summed by PostgreSQL itself, one JDBC partition (a day, or an id range of a big day)
per query, into one common shape ("sums") and a latency histogram.

Spark never decodes the rows: each partition's query groups them by the finest key every
report needs (day, tenant, app, component, provider, publishing domain, outcome, error code)
and by latency bucket, so what crosses JDBC is a few thousand rows per day whatever the
volume. Adding a source (e.g. the UnifiedPush deliveries) is one more `Source` in `SOURCES`:
its table, its time column, a cheap checksum for the fingerprint, and its two aggregate
queries. Nothing else changes: fingerprints, reads and every report pick it up.

Only table and column names of the relay are known here; nothing of its code is imported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row
from pyspark.sql import DataFrame, SparkSession

from analytics.config import Database
from analytics.schema import COUNT_COLUMNS, UNIFIEDPUSH

# What every source's sums query returns per partition, and the reports' finest key.
KEY_COLUMNS = (
    "tenant_id",
    "app_id",
    "component_id",
    "provider",
    "publishing_domain",
    "outcome",
    "error_code",
)
SUM_COLUMNS = ("day", *KEY_COLUMNS, "rows", *COUNT_COLUMNS)
SUM_SCHEMA = (
    "day date, tenant_id long, app_id long, component_id long, provider string, "
    "publishing_domain string, outcome string, error_code string, rows long, "
    + ", ".join(f"{name} long" for name in COUNT_COLUMNS)
)
HISTOGRAM_COLUMNS = ("day", "tenant_id", "app_id", "provider", "bucket", "n", "low")

# Latency buckets: 1 ms wide under 10 ms, then 1% wide (about 1,300 buckets up to an hour).
# A bucket keeps the smallest latency it holds, so a percentile is an actual latency of its
# group, within 1% (1 ms under 10 ms) below the exact one.
RELATIVE_ERROR = 0.01
BUCKET_SQL = (
    "CAST(CASE WHEN latency_ms < 10 THEN floor(latency_ms) "
    "ELSE 10 + floor(ln(latency_ms / 10) / ln(1.01)) END AS bigint)"
)

_ZERO = "CAST(0 AS bigint)"


def _zeros(*names: str) -> str:
    return ", ".join(f"{_ZERO} AS {name}" for name in names)


def _counted(condition: str) -> str:
    return f"count(*) FILTER (WHERE {condition})"


@dataclass(frozen=True, slots=True)
class Source:
    name: str
    table: str
    time_column: str
    # SQL aggregate over the day's rows that changes when a row is updated in place.
    checksum: str
    # The partition's rows summed by KEY_COLUMNS: SELECT ... (the key, then rows and
    # COUNT_COLUMNS) with {where} for the partition; "" for a source that is not pushes.
    sums: str = ""
    # The partition's delivered latencies by bucket: tenant_id, app_id, provider, bucket,
    # n, low (the smallest latency in ms); "" when the source has no answer time.
    histogram: str = ""
    # Slice big days into id ranges of about `rows_per_partition` rows each.
    split_days: bool = False


DELIVERIES = Source(
    name="deliveries",
    table="relay_delivery",
    time_column="received",
    # A redelivered or replayed push updates its row in place (same id, same count): its
    # outcome, attempts, error code or send time (the latency) change. Integer sums only
    # (hashing each row's text would cost more than the rest of the scan); the send time as
    # microseconds after the publish, summed exactly (numeric) and folded below 2^31.
    checksum="sum(attempts) + 1009 * count(sent) "
    "+ 7919 * count(*) FILTER (WHERE outcome = 'delivered') "
    "+ 104729 * count(*) FILTER (WHERE outcome = 'failed') + 3 * sum(length(error_code)) "
    "+ 31 * mod(coalesce(sum(CAST(date_part('epoch', sent - received) * 1000000 AS bigint)), 0), "
    "2147483647)",
    sums="SELECT tenant_id, app_id, CAST(NULL AS bigint) AS component_id, provider, "
    "lower(publishing_domain) AS publishing_domain, outcome, error_code, count(*) AS rows, "
    f"{_ZERO} AS publishes_received, count(*) AS pushes_sent, "
    + _counted("outcome = 'delivered'")
    + " AS delivered, "
    + _counted("outcome = 'dead_token'")
    + " AS dead_tokens, "
    + _counted("attempts > 1")
    + " AS retried, "
    + _counted("outcome = 'failed'")
    + " AS failed, "
    f"{_zeros('coalesced', 'rate_limited', 'refused', 'unavailable', 'bytes_relayed')} "
    "FROM relay_delivery WHERE {where} "
    "GROUP BY tenant_id, app_id, provider, lower(publishing_domain), outcome, error_code",
    histogram="SELECT tenant_id, app_id, provider, "
    f"{BUCKET_SQL} AS bucket, count(*) AS n, min(latency_ms) AS low FROM ("
    "SELECT tenant_id, app_id, provider, "
    "date_part('epoch', sent - received) * 1000 AS latency_ms FROM relay_delivery "
    "WHERE {where} AND outcome = 'delivered' AND sent IS NOT NULL) AS l "
    "GROUP BY tenant_id, app_id, provider, bucket",
    split_days=True,
)
TALLIES = Source(
    name="tallies",
    table="relay_publishtally",
    time_column="minute",
    checksum="sum(count)",  # upserts add to a row's count
    sums="SELECT tenant_id, app_id, CAST(NULL AS bigint) AS component_id, provider, "
    "publishing_domain, '' AS outcome, '' AS error_code, count(*) AS rows, "
    "CAST(sum(count) AS bigint) AS publishes_received, "
    f"{_zeros('pushes_sent', 'delivered', 'dead_tokens', 'retried', 'failed')}, "
    "CAST(coalesce(sum(count) FILTER (WHERE verdict = 'coalesced'), 0) AS bigint) "
    "AS coalesced, "
    "CAST(coalesce(sum(count) FILTER (WHERE verdict = 'rate-limited'), 0) AS bigint) "
    "AS rate_limited, "
    "CAST(coalesce(sum(count) FILTER (WHERE verdict IN ('unknown-node', 'forbidden')), 0) "
    "AS bigint) AS refused, "
    "CAST(coalesce(sum(count) FILTER (WHERE verdict = 'unavailable'), 0) AS bigint) "
    f"AS unavailable, {_ZERO} AS bytes_relayed "
    "FROM relay_publishtally WHERE {where} "
    "GROUP BY tenant_id, app_id, provider, publishing_domain",
)
# Written by the UnifiedPush app (relay.unifiedpush): one row per message once it ended,
# never updated. A message (a POST, or a Matrix gateway notification for one device) is a
# push of provider `up`: received and finished once; delivered when the phone answered; the
# other outcomes as the push counters closest to them (revoked: the phone's endpoint is
# gone, a dead token; expired and dropped: lost, failed; replaced by a newer message with its
# Topic: coalesced) and each by name as its error code. No app (the component says where it
# went), no publishing domain; its body bytes count once delivered.
UNIFIEDPUSH_DELIVERIES = Source(
    name="unifiedpush",
    table="relay_unifiedpushdelivery",
    time_column="received",
    checksum="sum(size) + 7 * sum(attempts)",
    sums="SELECT tenant_id, CAST(NULL AS bigint) AS app_id, "
    f"CAST(component_id AS bigint) AS component_id, '{UNIFIEDPUSH}' AS provider, "
    "CAST(NULL AS text) AS publishing_domain, outcome, "
    "CASE WHEN outcome = 'delivered' THEN '' ELSE outcome END AS error_code, "
    "count(*) AS rows, count(*) AS publishes_received, count(*) AS pushes_sent, "
    + _counted("outcome = 'delivered'")
    + " AS delivered, "
    + _counted("outcome = 'revoked'")
    + " AS dead_tokens, "
    + _counted("attempts > 1")
    + " AS retried, "
    + _counted("outcome IN ('expired', 'dropped')")
    + " AS failed, "
    + _counted("outcome = 'replaced'")
    + " AS coalesced, "
    f"{_zeros('rate_limited', 'refused', 'unavailable')}, "
    "CAST(coalesce(sum(size) FILTER (WHERE outcome = 'delivered'), 0) AS bigint) "
    "AS bytes_relayed "
    "FROM relay_unifiedpushdelivery WHERE {where} GROUP BY tenant_id, component_id, outcome",
    histogram="SELECT tenant_id, CAST(NULL AS bigint) AS app_id, "
    f"'{UNIFIEDPUSH}' AS provider, {BUCKET_SQL} AS bucket, count(*) AS n, "
    "min(latency_ms) AS low FROM (SELECT tenant_id, "
    "date_part('epoch', finished - received) * 1000 AS latency_ms "
    "FROM relay_unifiedpushdelivery WHERE {where} AND outcome = 'delivered') AS l "
    "GROUP BY tenant_id, bucket",
    split_days=True,
)
EVENTS = Source(
    name="events",
    table="relay_registrationevent",
    time_column="at",
    checksum="sum(live_change)",
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


@contextmanager
def connected(db: Database) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """A libpq connection whose rows are dicts, for the small statements the driver runs
    itself (fingerprints, retention cuts, names, registrations): no Spark job for those. A
    connection lost on the way is Unreachable, like one that could not be made."""
    conn = db.connect()
    try:
        conn.row_factory = dict_row  # type: ignore[assignment]
        yield conn  # type: ignore[misc]
    except psycopg.OperationalError as error:
        raise db.unreachable(str(error).splitlines()[0] if str(error) else "lost") from None
    finally:
        conn.close()


def query(conn: psycopg.Connection[Any], sql: str) -> list[dict[str, Any]]:
    return list(conn.execute(sql).fetchall())


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
    conn: psycopg.Connection[Any], first: date, last: date
) -> dict[date, dict[str, DayStats]]:
    """Per day and source, in one statement on the replica (one snapshot): index range scans
    and an aggregate, no rows leave PostgreSQL."""
    stats: dict[date, dict[str, DayStats]] = {}
    for row in query(conn, fingerprint_sql(first, last)):
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


def pruned_through(conn: psycopg.Connection[Any]) -> date | None:
    """The last day some of whose records the retention deleted (None: nothing pruned).

    Read after `day_stats`: the relay commits a cut before it deletes the rows, so every row
    missing from those fingerprints is covered by a cut this read sees."""
    days = [row["last_day"] for row in query(conn, pruned_through_sql())]
    return max(days, default=None)


@dataclass(frozen=True, slots=True)
class Partition:
    """What one JDBC partition reads of a source: a day, and an id range of it."""

    day: date
    low_id: int
    high_id: int  # excluded


_NO_ID_LIMIT = (-(2**63), 2**63 - 1)


def partitions(
    source: Source, days: Iterable[date], stats: dict[date, dict[str, DayStats]], per: int
) -> list[Partition]:
    """A day each, and a big day of a splittable source cut into id ranges of about `per`
    rows (ids grow with time, so a range is contiguous)."""
    found: list[Partition] = []
    for day in days:
        day_stat = stats.get(day, {}).get(source.name)
        if day_stat is None:
            continue  # nothing on that day: no query at all
        slices = math.ceil(day_stat.rows / per) if source.split_days else 1
        if slices <= 1:
            found.append(Partition(day, *_NO_ID_LIMIT))
            continue
        span = day_stat.max_id - day_stat.min_id + 1
        step = math.ceil(span / slices)
        for low in range(day_stat.min_id, day_stat.max_id + 1, step):
            found.append(Partition(day, low, low + step))
    return found


def partitioned_sql(source: Source, template: str, parts: list[Partition]) -> str:
    """`template` once per partition, its bounds written in, as branches of a UNION ALL
    tagged `part`: Spark's predicate `part = n` leaves PostgreSQL one branch to run (the
    others are constant-false and never executed), so each JDBC partition is one index range
    scan and one aggregate, planned with the partition's own bounds."""
    branches = []
    for n, part in enumerate(parts):
        where = _day_range(source, part.day, part.day)
        if (part.low_id, part.high_id) != _NO_ID_LIMIT:
            where += f" AND id >= {part.low_id} AND id < {part.high_id}"
        branches.append(
            f"SELECT {n} AS part, DATE '{part.day}' AS day, s.* "
            f"FROM ({template.replace('{where}', where)}) AS s"
        )
    return "(" + " UNION ALL ".join(branches) + ") AS q"


def _read(
    spark: SparkSession, db: Database, source: Source, template: str, parts: list[Partition]
) -> DataFrame:
    return spark.read.jdbc(
        db.jdbc_url,
        partitioned_sql(source, template, parts),
        predicates=[f"part = {n}" for n in range(len(parts))],
        properties=db.jdbc_properties,
    ).drop("part")


def read_sums(
    spark: SparkSession,
    db: Database,
    days: list[date],
    stats: dict[date, dict[str, DayStats]],
    *,
    rows_per_partition: int,
) -> tuple[DataFrame, DataFrame, int]:
    """Every push source's rows of `days` summed by PostgreSQL per partition (SUM_COLUMNS),
    their latency histograms (HISTOGRAM_COLUMNS), and how many JDBC partitions read them."""
    sums: list[DataFrame] = []
    histograms: list[DataFrame] = []
    count = 0
    for source in SOURCES:
        if not source.sums:
            continue
        parts = partitions(source, days, stats, rows_per_partition)
        if not parts:
            continue
        count += len(parts)
        sums.append(_read(spark, db, source, source.sums, parts).select(*SUM_COLUMNS))
        if source.histogram:
            histograms.append(
                _read(spark, db, source, source.histogram, parts).select(*HISTOGRAM_COLUMNS)
            )
    return (
        _union(spark, sums, SUM_SCHEMA),
        _union(spark, histograms, HISTOGRAM_SCHEMA),
        count,
    )


HISTOGRAM_SCHEMA = (
    "day date, tenant_id long, app_id long, provider string, bucket long, n long, low double"
)


def _union(spark: SparkSession, frames: list[DataFrame], schema: str) -> DataFrame:
    if not frames:
        return spark.createDataFrame([], schema)
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionByName(frame)
    return union


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


def names(conn: psycopg.Connection[Any]) -> tuple[dict[int, str], dict[int, str], dict[int, str]]:
    """Tenant and app names and component JIDs (a server's, never a user's) by id (small
    tables): the reports name what they count."""
    found: dict[str, dict[int, str]] = {"tenant": {}, "app": {}, "component": {}}
    for row in query(
        conn,
        "SELECT 'tenant' AS kind, id, name FROM relay_tenant UNION ALL "
        "SELECT 'app', id, name FROM relay_app UNION ALL "
        "SELECT 'component', id, jid FROM relay_component",
    ):
        found[row["kind"]][int(row["id"])] = row["name"]
    return found["tenant"], found["app"], found["component"]
