"""The reports as DataFrame transformations: sums in, one DataFrame per report out.

Latency percentiles come from histograms PostgreSQL builds per partition (analytics.sources:
1 ms buckets under 10 ms, 1% buckets above, each keeping the smallest latency it holds): the
value returned for percentile p is an actual latency of the group, at most 1% (1 ms under
10 ms) below the exact value of rank ceil(p * n) among its n latencies, and equal to it when
that bucket holds one distinct value.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from datetime import date, timedelta
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from analytics.config import Thresholds
from analytics.schema import COUNT_COLUMNS, UNIFIEDPUSH, UNIFIEDPUSH_OUTCOMES
from analytics.sources import KEY_COLUMNS

PERCENTILES = (0.5, 0.95, 0.99)


# grouping_id() over (day, tenant_id, app_id, provider): which columns a row sums over.
LEVELS = {0: "provider", 1: "app", 3: "tenant", 7: "all"}

USAGE_SCHEMA = (
    "day date, level string, tenant_id long, app_id long, provider string, "
    + ", ".join(f"{name} long" for name in COUNT_COLUMNS)
    + ", success_rate double, latency_p50_ms double, latency_p95_ms double, "
    "latency_p99_ms double"
)


def _ratio(numerator: str, denominator: str) -> F.Column:
    return F.when(F.col(denominator) > 0, F.col(numerator) / F.col(denominator))


# The key the sums are merged by once, before any report: every report's key is a part of
# it, so the reports read this small table instead of the rows.
FINE_KEY = ("day", *KEY_COLUMNS)


def summed(sums: DataFrame) -> DataFrame:
    """The partitions' sums merged per FINE_KEY (a key a big day's id ranges share)."""
    return sums.groupBy(*FINE_KEY).agg(
        *[F.sum(name).alias(name) for name in ("rows", *COUNT_COLUMNS)]
    )


_SETS = (
    "GROUPING SETS ((day, tenant_id, app_id, provider), (day, tenant_id, app_id), "
    "(day, tenant_id), (day))"
)
# The grouping sets' keys as grouping_id() numbers them: which of the key's columns count.
_LEVEL_KEYS = {0: (True, True, True), 1: (True, True, False), 3: (True, False, False)}
LATENCY_SCHEMA = (
    "day date, g int, tenant_id long, app_id long, provider string, latency array<double>"
)


def percentile_rows(histogram: Iterable[Any]) -> list[tuple]:
    """Per day and grouping set (as `usage` numbers them), p50/p95/p99 from the merged
    histogram rows (day, tenant_id, app_id, provider, bucket, n, low): the smallest latency
    of the bucket where the rank ceil(p * n) falls."""
    groups: dict[tuple, dict[int, list]] = defaultdict(dict)
    for row in histogram:
        day, tenant, app, provider = row["day"], row["tenant_id"], row["app_id"], row["provider"]
        for g, (has_tenant, has_app, has_provider) in (*_LEVEL_KEYS.items(), (7, (False,) * 3)):
            key = (
                day,
                g,
                tenant if has_tenant else None,
                app if has_app else None,
                provider if has_provider else None,
            )
            bucket = groups[key].get(row["bucket"])
            if bucket is None:
                groups[key][row["bucket"]] = [row["n"], row["low"]]
            else:
                bucket[0] += row["n"]
                bucket[1] = min(bucket[1], row["low"])
    result = []
    for key, buckets in groups.items():
        ordered = sorted(buckets.items())
        total = sum(n for _, (n, _) in ordered)
        values = []
        for p in PERCENTILES:
            rank, seen = max(1, math.ceil(p * total)), 0
            for _, (n, low) in ordered:
                seen += n
                if seen >= rank:
                    values.append(float(low))
                    break
        result.append((*key, values))
    return result


def usage(sums: DataFrame, latencies: DataFrame) -> DataFrame:
    """Per day at four levels (tenant+app+provider, tenant+app, tenant, all tenants): the
    counts (from `summed`) and the publish -> provider answer latency of delivered pushes
    (`latencies`: `percentile_rows` as a DataFrame of LATENCY_SCHEMA)."""
    spark = sums.sparkSession
    sums.createOrReplaceTempView("sums")
    totals = ", ".join(f"sum({name}) AS {name}" for name in COUNT_COLUMNS)
    counts = spark.sql(
        f"SELECT day, grouping_id() AS g, tenant_id, app_id, provider, {totals} FROM sums "
        f"GROUP BY day, tenant_id, app_id, provider {_SETS}"
    )
    keys = ["day", "g", "tenant_id", "app_id", "provider"]
    joined = counts.alias("c").join(
        F.broadcast(latencies).alias("l"),
        [F.col(f"c.{key}").eqNullSafe(F.col(f"l.{key}")) for key in keys],
        "left",
    )
    level = F.create_map(*[F.lit(x) for pair in LEVELS.items() for x in pair])
    return joined.select(
        F.col("c.day").alias("day"),
        level[F.col("c.g")].alias("level"),
        F.col("c.tenant_id").alias("tenant_id"),
        F.col("c.app_id").alias("app_id"),
        F.coalesce(F.col("c.provider"), F.lit("")).alias("provider"),
        *[F.col(f"c.{name}").alias(name) for name in COUNT_COLUMNS],
        _ratio("delivered", "pushes_sent").alias("success_rate"),
        F.col("l.latency")[0].alias("latency_p50_ms"),
        F.col("l.latency")[1].alias("latency_p95_ms"),
        F.col("l.latency")[2].alias("latency_p99_ms"),
    )


def domains(sums: DataFrame) -> DataFrame:
    """Every publishing domain of every tenant and day: volume and failures (UnifiedPush
    messages have no publishing domain)."""
    return (
        sums.where(F.col("publishing_domain").isNotNull())
        .groupBy("day", "tenant_id", "publishing_domain")
        .agg(
            F.sum("publishes_received").alias("publishes_received"),
            F.sum("pushes_sent").alias("pushes_sent"),
            F.sum("failed").alias("failed"),
        )
        .withColumn("failure_rate", _ratio("failed", "pushes_sent"))
    )


def top_domains(all_domains: DataFrame, *, top: int, min_sends: int) -> DataFrame:
    """A tenant's top `top` domains of the day by volume, and by failure rate among those
    with at least `min_sends` pushes (a rate of two pushes means nothing)."""
    per_tenant = Window.partitionBy("day", "tenant_id")
    by_volume = per_tenant.orderBy(
        F.desc("publishes_received"), F.desc("pushes_sent"), "publishing_domain"
    )
    by_failure = per_tenant.orderBy(F.desc("failure_rate"), F.desc("failed"), "publishing_domain")
    ranked = all_domains.withColumn("rank_by_volume", F.row_number().over(by_volume))
    eligible = (F.col("pushes_sent") >= min_sends) & (F.col("failed") > 0)
    failure_ranks = (
        ranked.where(eligible)
        .withColumn("rank_by_failure_rate", F.row_number().over(by_failure))
        .select("day", "tenant_id", "publishing_domain", "rank_by_failure_rate")
    )
    ranked = ranked.join(failure_ranks, ["day", "tenant_id", "publishing_domain"], "left")
    return ranked.where(
        (F.col("rank_by_volume") <= top) | (F.col("rank_by_failure_rate") <= top)
    ).withColumn(
        "rank_by_volume",
        F.when(F.col("rank_by_volume") <= top, F.col("rank_by_volume")),
    )


def error_codes(sums: DataFrame) -> DataFrame:
    """Provider error codes per day, tenant, app, provider and outcome."""
    return (
        sums.where(F.col("error_code") != "")
        .groupBy("day", "tenant_id", "app_id", "provider", "outcome", "error_code")
        .agg(F.sum("pushes_sent").alias("count"))
    )


UNIFIEDPUSH_SCHEMA = (
    "day date, tenant_id long, component_id long, received long, "
    + ", ".join(f"{name} long" for name in UNIFIEDPUSH_OUTCOMES)
    + ", bytes_relayed long"
)


def unifiedpush(sums: DataFrame) -> DataFrame:
    """UnifiedPush messages per day, tenant and component: received, how each ended, and the
    body bytes handed to phones."""
    outcomes = [
        F.sum(F.when(F.col("outcome") == name, F.col("pushes_sent")).otherwise(0)).alias(name)
        for name in UNIFIEDPUSH_OUTCOMES
    ]
    return (
        sums.where(F.col("provider") == UNIFIEDPUSH)
        .groupBy("day", "tenant_id", "component_id")
        .agg(
            F.sum("publishes_received").alias("received"),
            *outcomes,
            F.sum("bytes_relayed").alias("bytes_relayed"),
        )
    )


REGISTRATION_SCHEMA = (
    "day date, tenant_id long, app_id long, provider string, active long, new long, "
    "renewed long, died long, removed long"
)
_KIND_COLUMNS = {"created": "new", "renewed": "renewed", "died": "died", "removed": "removed"}


def registrations(rows: Iterable[dict], days: Iterable[date]) -> list[dict]:
    """Per day and tenant, app and provider: live at the day's end, and the day's events.

    `rows` is `sources.registration_sql`'s answer (small): today's live count per key and
    the events per day since the first day. Live at the end of day D is today's count minus
    the changes logged after D.
    """
    live: dict[tuple[int, int, str], int] = defaultdict(int)
    changes: dict[tuple[int, int, str], dict[date, int]] = defaultdict(lambda: defaultdict(int))
    counts: dict[tuple[date, int, int, str], dict[str, int]] = defaultdict(
        lambda: dict.fromkeys(_KIND_COLUMNS.values(), 0)
    )
    for row in rows:
        key = (int(row["tenant_id"]), int(row["app_id"]), row["provider"])
        if row["part"] == "live":
            live[key] += int(row["n"])
            continue
        changes[key][row["day"]] += int(row["change"])
        column = _KIND_COLUMNS.get(row["kind"])
        if column:
            counts[(row["day"], *key)][column] += int(row["n"])
    result = []
    for day in days:
        for key in sorted(set(live) | set(changes)):
            later = sum(change for when, change in changes[key].items() if when > day)
            active = live[key] - later
            day_counts = counts.get((day, *key), dict.fromkeys(_KIND_COLUMNS.values(), 0))
            if active == 0 and not any(day_counts.values()):
                continue
            tenant_id, app_id, provider = key
            result.append(
                {
                    "day": day,
                    "tenant_id": tenant_id,
                    "app_id": app_id,
                    "provider": provider,
                    "active": active,
                    **day_counts,
                }
            )
    return result


ANOMALY_SCHEMA = (
    "day date, scope string, tenant_id long, app_id long, publishing_domain string, "
    "metric string, value double, baseline double, threshold double, pushes_sent long"
)

# Tenants and domains have no app: a key that joins (NULL never equals NULL in a join).
NO_APP = -1


def baselines(
    usage_history: DataFrame, domain_history: DataFrame, report_days: list[date]
) -> list[dict]:
    """Per report day and entity (tenant, app, publishing domain): the day's volume, pushes
    sent and failed, and the same summed over the seven days before (a day without rows
    counts as 0). One Spark pass over the daily aggregates; the result is small."""
    spark = usage_history.sparkSession
    if not report_days:
        return []
    first = min(report_days) - timedelta(days=7)
    days = [first + timedelta(days=n) for n in range((max(report_days) - first).days + 1)]
    columns = [
        F.col("publishes_received").alias("volume"),
        F.col("pushes_sent"),
        F.col("failed"),
    ]
    history = (
        usage_history.where(F.col("level") == "tenant")
        .select(
            F.lit("tenant").alias("scope"),
            "day",
            "tenant_id",
            F.lit(NO_APP).cast("long").alias("app_id"),
            F.lit("").alias("publishing_domain"),
            *columns,
        )
        .unionByName(
            usage_history.where(F.col("level") == "app").select(
                F.lit("app").alias("scope"),
                "day",
                "tenant_id",
                "app_id",
                F.lit("").alias("publishing_domain"),
                *columns,
            )
        )
        .unionByName(
            domain_history.select(
                F.lit("domain").alias("scope"),
                "day",
                "tenant_id",
                F.lit(NO_APP).cast("long").alias("app_id"),
                "publishing_domain",
                *columns,
            )
        )
        .where(F.col("day").between(days[0], days[-1]))
    )
    keys = ["scope", "tenant_id", "app_id", "publishing_domain"]
    grid = (
        history.select(*keys)
        .distinct()
        .crossJoin(spark.createDataFrame([(day,) for day in days], "day date"))
        .join(history, [*keys, "day"], "left")
        .fillna(0, subset=["volume", "pushes_sent", "failed"])
    )
    before = Window.partitionBy(*keys).orderBy(F.unix_date("day")).rangeBetween(-7, -1)
    rows = (
        grid.withColumn("base_volume", F.coalesce(F.sum("volume").over(before), F.lit(0)))
        .withColumn("base_sent", F.coalesce(F.sum("pushes_sent").over(before), F.lit(0)))
        .withColumn("base_failed", F.coalesce(F.sum("failed").over(before), F.lit(0)))
        .where(F.col("day").isin(report_days))
        .collect()
    )
    return [row.asDict() for row in rows]


def anomalies(rows: list[dict], thresholds: Thresholds) -> list[dict]:
    """Entities whose volume (publishes received) or failure rate (failed / pushes sent)
    moved beyond the thresholds against their own previous seven days: the mean volume per
    day, and the failure rate of those days' pushes together."""
    found = []
    change = 1.0 + thresholds.volume_change
    for row in rows:
        common = {
            "day": row["day"],
            "scope": row["scope"],
            "tenant_id": row["tenant_id"],
            "app_id": None if row["app_id"] == NO_APP else row["app_id"],
            "publishing_domain": row["publishing_domain"],
            "pushes_sent": int(row["pushes_sent"]),
        }
        volume, baseline = float(row["volume"]), row["base_volume"] / 7.0
        if (
            baseline > 0
            and max(volume, baseline) >= thresholds.min_volume
            and (volume > baseline * change or volume < baseline / change)
        ):
            found.append(
                common
                | {
                    "metric": "volume",
                    "value": volume,
                    "baseline": baseline,
                    "threshold": thresholds.volume_change,
                }
            )
        if row["pushes_sent"] >= thresholds.min_volume and row["base_sent"] > 0:
            rate = row["failed"] / row["pushes_sent"]
            base_rate = row["base_failed"] / row["base_sent"]
            if rate - base_rate >= thresholds.failure_rate_change - 1e-12:
                found.append(
                    common
                    | {
                        "metric": "failure_rate",
                        "value": rate,
                        "baseline": base_rate,
                        "threshold": thresholds.failure_rate_change,
                    }
                )
    return found


def describe_anomaly(row: dict) -> str:
    """The figures that triggered it, in words."""
    if row["metric"] == "volume":
        factor = row["value"] / row["baseline"] if row["baseline"] else float("inf")
        return (
            f"volume {row['value']:.0f} publishes vs {row['baseline']:.1f}/day over the previous "
            f"7 days (x{factor:.2f}; threshold x{1 + row['threshold']:.2f} either way)"
        )
    return (
        f"failure rate {100 * row['value']:.1f}% of {row['pushes_sent']} pushes vs "
        f"{100 * row['baseline']:.1f}% over the previous 7 days "
        f"(+{100 * (row['value'] - row['baseline']):.1f} points; threshold "
        f"+{100 * row['threshold']:.1f})"
    )


def empty(spark: SparkSession, schema: str) -> DataFrame:
    return spark.createDataFrame([], schema)
