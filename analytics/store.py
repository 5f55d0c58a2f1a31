"""The Parquet outputs, partitioned by day under one root (a local path or any Hadoop URI),
and the fingerprints of the days they hold.

A day is replaced whole: its partition folders are deleted, then the new rows appended, so a
re-run leaves exactly one copy, and a day that became empty leaves none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import date
from typing import Any, cast

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

DATASETS = ("usage", "registrations", "domains", "error_codes", "unifiedpush", "anomalies")
FINGERPRINTS = "_fingerprints"


class _HadoopFs:
    """The one place that reaches into Spark's JVM: PySpark has no Python API to delete or
    test a path on the Hadoop file system (local, HDFS, S3A...), which a day's replacement
    needs. `_jvm` and `_jsc` are PySpark internals, stable across 3.x and 4.x."""

    def __init__(self, spark: SparkSession, root: str) -> None:
        self._jvm: Any = cast(Any, spark.sparkContext._jvm)  # set once the context runs
        conf = spark.sparkContext._jsc.hadoopConfiguration()
        self._root = self._jvm.org.apache.hadoop.fs.Path(root)
        self._fs = self._root.getFileSystem(conf)

    def _path(self, relative: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(self._root, relative)

    def exists(self, relative: str) -> bool:
        return bool(self._fs.exists(self._path(relative)))

    def delete(self, relative: str) -> None:
        self._fs.delete(self._path(relative), True)


def _root(output: str) -> str:
    return output.rstrip("/")


def replace_days(
    spark: SparkSession, output: str, name: str, frame: DataFrame, days: Iterable[date]
) -> None:
    """Write `frame` as the whole content of `days` in dataset `name`."""
    fs = _HadoopFs(spark, _root(output))
    for day in days:
        fs.delete(f"{name}/day={day.isoformat()}")
    # One file per day: the aggregates are small, and every later read of a day (anomalies,
    # exports) pays per file, not per row.
    frame.repartition("day").write.mode("append").partitionBy("day").parquet(
        f"{_root(output)}/{name}"
    )


def read_days(
    spark: SparkSession, output: str, name: str, first: date, last: date, schema: str
) -> DataFrame:
    """A dataset's rows of [first, last] (partition pruning reads only those folders)."""
    fs = _HadoopFs(spark, _root(output))
    if not fs.exists(name):
        return spark.createDataFrame([], schema)
    # The schema is given: a day written empty leaves no file to infer one from.
    frame = spark.read.schema(schema).parquet(f"{_root(output)}/{name}")
    return frame.where(F.col("day").between(first, last))


def read_fingerprints(spark: SparkSession, output: str) -> dict[date, str]:
    fs = _HadoopFs(spark, _root(output))
    if not fs.exists(FINGERPRINTS):
        return {}
    rows = spark.read.json(f"{_root(output)}/{FINGERPRINTS}").collect()
    return {date.fromisoformat(row["day"]): row["fingerprint"] for row in rows}


def write_fingerprints(spark: SparkSession, output: str, fingerprints: dict[date, str]) -> None:
    """Replace the fingerprints (all of them: a few hundred short lines at most)."""
    lines = [
        json.dumps({"day": day.isoformat(), "fingerprint": value})
        for day, value in sorted(fingerprints.items())
    ]
    frame = spark.createDataFrame([(line,) for line in lines], "value string")
    frame.coalesce(1).write.mode("overwrite").text(f"{_root(output)}/{FINGERPRINTS}")
