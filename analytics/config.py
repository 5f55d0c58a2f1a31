"""What a report run needs, from the environment and the command line; no Django here.

The ANALYTICS_* variables (and DATABASE_URL, VAR_DIR) are read through relay.environment,
the one typed declaration of every setting (Django-free; the import contracts let analytics
import it).

The job runs under `manage.py run_reports`, under `spark-submit` on a cluster, or from the
Celery beat task: all three hand it the same arguments and environment.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import psycopg
from pydantic import ValidationError

from relay.environment import Environment

DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"  # Debian: libpostgresql-jdbc-java
JDBC_DRIVER = "org.postgresql.Driver"


class ConfigError(ValueError):
    """A setting the job cannot run with; the message says which and why."""


class Unreachable(ConfigError):
    """A database the job cannot connect to: the message says which (setting, host, port,
    database name, never the password) and why, in one line."""


@dataclass(frozen=True, slots=True)
class Database:
    """A PostgreSQL database as JDBC (for Spark) and libpq (for the writer) want it."""

    host: str
    port: int
    name: str
    user: str
    password: str = field(repr=False, default="")
    setting: str = field(compare=False, default="")  # where it was configured, for messages

    @classmethod
    def from_url(cls, url: str, *, setting: str) -> Database:
        parts = urlsplit(url)
        if parts.scheme not in ("postgres", "postgresql", "pgsql"):
            raise ConfigError(
                f"{setting} must be a PostgreSQL URL (postgres://user@host:5432/db); "
                f"the reports read over the PostgreSQL JDBC driver only, not {parts.scheme!r}"
            )
        name = parts.path.lstrip("/")
        if not parts.hostname or not name:
            raise ConfigError(f"{setting} needs a host and a database name")
        return cls(
            host=parts.hostname,
            port=parts.port or 5432,
            name=unquote(name),
            user=unquote(parts.username or "postgres"),
            password=unquote(parts.password or ""),
            setting=setting,
        )

    @property
    def jdbc_url(self) -> str:
        # No credentials in the URL: Spark may print it; they go in the properties.
        return f"jdbc:postgresql://{self.host}:{self.port}/{self.name}"

    @property
    def jdbc_properties(self) -> dict[str, str]:
        properties = {"user": self.user, "driver": JDBC_DRIVER}
        if self.password:
            properties["password"] = self.password
        return properties

    @property
    def libpq(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "dbname": self.name,
            "user": self.user,
            "password": self.password,
        }

    def describe(self) -> str:
        """For progress lines: where, never the password."""
        return f"{self.user}@{self.host}:{self.port}/{self.name}"

    def unreachable(self, reason: str) -> Unreachable:
        """The one line that says this database could not be reached, and why."""
        if self.password:
            reason = reason.replace(self.password, "***")
        where = f"{self.host}:{self.port}, database {self.name}"
        return Unreachable(f"cannot reach {self.setting or 'the database'} ({where}): {reason}")

    def connect(self, *, timeout: int = 10) -> psycopg.Connection:
        """A libpq connection, or Unreachable (libpq's reason, its hint lines left out)."""
        try:
            return psycopg.connect(**self.libpq, connect_timeout=timeout)
        except psycopg.OperationalError as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            # "connection failed: connection to server at "h", port p failed: <reason>"
            reason = lines[0].rsplit(" failed: ", 1)[-1] if lines else type(error).__name__
            raise self.unreachable(reason) from None


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a day's figure is an anomaly against the entity's own previous seven days."""

    # Volume: flagged when above baseline x (1 + change) or below baseline / (1 + change).
    volume_change: float = 1.0
    # Failure rate: flagged when it rose by at least this much (absolute, 0.1 = 10 points).
    failure_rate_change: float = 0.1
    # Ignore entities with fewer publishes (or pushes, for failure rates) than this.
    min_volume: int = 50


@dataclass(frozen=True, slots=True)
class JobConfig:
    source: Database  # the read replica the Spark jobs read
    primary: Database | None  # where the daily aggregates are loaded; None: not loaded
    output: str  # Parquet root: a local path or any Hadoop URI (hdfs://, s3a://, file://)
    export_dir: Path  # local: the HTML report and the monthly CSV exports
    since: date
    until: date
    master: str | None = None  # None under spark-submit (it says), else local[*]
    jdbc_jar: str = DEFAULT_JDBC_JAR
    driver_memory: str = "2g"
    rows_per_partition: int = 500_000
    shuffle_partitions: int = 4
    top_domains: int = 10
    min_sends_for_failure_rank: int = 10
    thresholds: Thresholds = Thresholds()
    force: bool = False  # recompute every day of the range, changed or not
    # The day the run writes its files (a month's export written up to its last day is partial).
    today: date = field(default_factory=lambda: datetime.now(UTC).date())

    @property
    def days(self) -> list[date]:
        return [self.since + timedelta(days=n) for n in range((self.until - self.since).days + 1)]


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a day (YYYY-MM-DD): {text!r}") from None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="analytics.jobs",
        description="Daily reports over the relay's records (a PostgreSQL read replica).",
    )
    parser.add_argument("--since", type=_day, help="first day (UTC); default: yesterday")
    parser.add_argument("--until", type=_day, help="last day (UTC); default: today")
    parser.add_argument("--master", help="Spark master, e.g. local[2] or spark://host:7077")
    parser.add_argument("--output", help="Parquet root (ANALYTICS_OUTPUT)")
    parser.add_argument("--export-dir", help="HTML and CSV folder (ANALYTICS_EXPORT_DIR)")
    parser.add_argument("--force", action="store_true", help="recompute unchanged days too")
    parser.add_argument("--no-load", action="store_true", help="do not load the primary")
    parser.add_argument(
        "--rows-per-partition", type=int, help="delivery rows per JDBC read (default 500000)"
    )
    return parser


def settings_of(env: dict[str, str]) -> Environment:
    """The relay's typed settings (relay.environment, where every variable is declared) from
    `env`; empty values count as unset. A value of the wrong type is a ConfigError naming it."""
    try:
        return Environment.model_validate({k: v for k, v in env.items() if v.strip()})
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
            for problem in error.errors()
        )
        raise ConfigError(f"bad setting: {problems}") from None


def from_args(argv: list[str] | None = None, env: dict[str, str] | None = None) -> JobConfig:
    env = dict(os.environ if env is None else env)
    args = parser().parse_args(argv)
    settings = settings_of(env)
    today = datetime.now(UTC).date()
    since = args.since or today - timedelta(days=1)
    until = args.until or max(today, since)
    if until < since:
        raise ConfigError(f"--until {until} is before --since {since}")
    primary_url = settings.database_url
    source_url = settings.analytics_database_url or primary_url
    if not source_url:
        raise ConfigError("set ANALYTICS_DATABASE_URL (the read replica) or DATABASE_URL")
    var_dir = settings.var_dir
    primary = None
    if primary_url and not args.no_load:
        primary = Database.from_url(primary_url, setting="DATABASE_URL")
    return JobConfig(
        source=Database.from_url(
            source_url,
            setting="ANALYTICS_DATABASE_URL" if settings.analytics_database_url else "DATABASE_URL",
        ),
        primary=primary,
        output=args.output or settings.analytics_output or str((var_dir / "reports").resolve()),
        export_dir=Path(
            args.export_dir or settings.analytics_export_dir or var_dir / "reports-export"
        ),
        since=since,
        until=until,
        master=args.master or settings.analytics_spark_master or None,
        jdbc_jar=settings.analytics_jdbc_jar,
        driver_memory=settings.analytics_driver_memory,
        rows_per_partition=args.rows_per_partition or settings.analytics_rows_per_partition,
        shuffle_partitions=settings.analytics_shuffle_partitions,
        thresholds=Thresholds(
            volume_change=settings.analytics_volume_change,
            failure_rate_change=settings.analytics_failure_rate_change,
            min_volume=settings.analytics_min_volume,
        ),
        force=args.force,
        today=today,
    )
