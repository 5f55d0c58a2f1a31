"""Private PostgreSQL, Redis and RabbitMQ servers on free ports, started and stopped by the tests.

Nothing here touches a server the machine already runs: each instance lives in a folder of
its own, listens on loopback on a free port, and is gone when the test (or the session) ends.
Fault tests restart them mid-stream (`restart`, `stop` and `start`, `kill`), and the reports'
tests make a streaming replica of a primary (`PrivatePostgres.replica`).

Run as a program, it wraps the test session (the Makefile does this)::

    python -m tests.support.services -- python -m pytest ...

and starts a private PostgreSQL unless TEST_DATABASE_URL is given, a private RabbitMQ (the
broker, tests/support/rabbitmq.py) unless TEST_BROKER_URL is given, a private Redis (state
and cache) unless TEST_STATE_URL is given, exports DATABASE_URL, CELERY_BROKER_URL,
CACHE_URL and RELAY_STATE_URL for the command, and stops what it started when the command
ends. Two runs on one machine therefore never share a database, a broker or a Redis db.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.ports import LOOPBACK, free_port, port_accepts
from tests.support.rabbitmq import PrivateRabbit
from tests.support.waiting import wait_until

POSTGRES_BIN_ROOT = Path("/usr/lib/postgresql")
# Never durable: these servers exist for one test run. Crash safety is what fault tests
# exercise through a clean restart (`pg_ctl stop -m fast` / `-m immediate`), not fsync.
POSTGRES_OPTIONS = {
    "listen_addresses": LOOPBACK,
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "64MB",
    "wal_level": "replica",
    "max_wal_senders": "5",
    "hot_standby": "on",
    "log_min_messages": "warning",
}


class ServiceError(RuntimeError):
    """A private server would not start or stop."""


def postgres_bin(name: str) -> str:
    """The path of a PostgreSQL server program (the newest installed major version)."""
    versions = sorted(
        (path for path in POSTGRES_BIN_ROOT.glob("*/bin") if (path / name).exists()),
        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
    )
    if versions:
        return str(versions[-1] / name)
    found = shutil.which(name)
    if found is None:
        raise ServiceError(f"{name} not found: install postgresql (`make test` does, as root)")
    return found


def _as_postgres_user(argv: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the `postgres` system user."""
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


def _chown_to_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, user="postgres", group="postgres")


def _run(argv: list[str], *, timeout: float = 60.0) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise ServiceError(f"{' '.join(argv[:4])}... failed: {result.stderr.strip()[-2000:]}")
    return result.stdout


def _wait_for_port(
    port: int,
    timeout: float,
    what: str,
    log: Path | None = None,
    process: subprocess.Popen[bytes] | None = None,
) -> None:
    """Until the server accepts on `port`; a server that exits or never listens says why (the
    end of its log)."""

    def tail() -> str:
        text = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
        return f"{what} did not listen on port {port}\n{text}"

    def listening() -> bool:
        if process is not None and process.poll() is not None:
            raise ServiceError(f"{what} exited with {process.returncode}: {tail()}")
        return port_accepts(port)

    try:
        wait_until(listening, timeout, tail)
    except TimeoutError as error:
        raise ServiceError(str(error)) from None


class PrivatePostgres:
    """A PostgreSQL cluster of our own: `initdb` in a temporary folder, trust auth."""

    def __init__(self, workdir: Path | None = None, *, port: int | None = None) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="relay-pg-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        _chown_to_postgres(self.workdir)
        self.data = self.workdir / "data"
        self.port = port or free_port()
        self.log = self.workdir / "postgres.log"

    # --- life cycle

    def init(self) -> PrivatePostgres:
        _run(
            _as_postgres_user(
                [
                    postgres_bin("initdb"),
                    "-D",
                    str(self.data),
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ]
            )
        )
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host replication all {LOOPBACK}/32 trust\n")
        return self

    def _options(self) -> str:
        options = {**POSTGRES_OPTIONS, "port": str(self.port)}
        flags = " ".join(f"-c {key}={value}" for key, value in options.items())
        return f"{flags} -k {self.workdir}"

    def start(self, timeout: float = 60.0) -> PrivatePostgres:
        if not self.data.exists():
            self.init()
        _run(
            _as_postgres_user(
                [
                    postgres_bin("pg_ctl"),
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-o",
                    self._options(),
                    "-w",
                    "-t",
                    str(int(timeout)),
                    "start",
                ]
            ),
            timeout=timeout + 10,
        )
        _wait_for_port(self.port, timeout, "postgres", self.log)
        return self

    def stop(self, mode: str = "fast", timeout: float = 30.0) -> None:
        """`pg_ctl stop -m fast` (clients are disconnected, like a restart by an operator)."""
        if not self.running():
            return
        _run(
            _as_postgres_user(
                [
                    postgres_bin("pg_ctl"),
                    "-D",
                    str(self.data),
                    "-m",
                    mode,
                    "-w",
                    "-t",
                    str(int(timeout)),
                    "stop",
                ]
            ),
            timeout=timeout + 10,
        )

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        if down_seconds:
            time.sleep(down_seconds)
        self.start()

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def close(self) -> None:
        with contextlib.suppress(ServiceError, subprocess.TimeoutExpired):
            self.stop(mode="immediate")
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- use

    def url(self, dbname: str = "postgres") -> str:
        return f"postgres://postgres@{LOOPBACK}:{self.port}/{dbname}"

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        """Run SQL through psql; returns its unaligned, tuples-only output."""
        return _run(
            [
                "psql",
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                LOOPBACK,
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                dbname,
                "-c",
                sql,
            ]
        ).strip()

    def create_database(self, name: str) -> str:
        self.psql(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def replica(self, workdir: Path | None = None) -> PrivatePostgres:
        """A hot standby streaming from this primary (`pg_basebackup -R`), started."""
        standby = PrivatePostgres(workdir)
        _run(
            _as_postgres_user(
                [
                    "pg_basebackup",
                    "-h",
                    LOOPBACK,
                    "-p",
                    str(self.port),
                    "-U",
                    "postgres",
                    "-D",
                    str(standby.data),
                    "-R",
                    "-X",
                    "stream",
                    "--no-sync",
                ]
            ),
            timeout=120,
        )
        return standby.start()


class PrivateRedis:
    """A redis-server of our own that keeps nothing on disk, unless `durable`: then an
    append-only file fsynced at every write, as a broker should run in production, so that a
    restart (or a kill) keeps the queued sends, as the broker fault tests need."""

    def __init__(self, *, port: int | None = None, durable: bool = False) -> None:
        self.port = port or free_port()
        self.durable = durable
        self.workdir = Path(tempfile.mkdtemp(prefix="relay-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> PrivateRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceError("redis-server not found: install redis-server (`make test` does)")
        argv = [
            binary,
            "--bind",
            LOOPBACK,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "yes" if self.durable else "no",
            "--appendfsync",
            "always",
            "--dir",
            str(self.workdir),
            "--databases",
            "16",
        ]
        with (self.workdir / "redis.log").open("ab") as log:  # the server keeps its own copy
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        _wait_for_port(self.port, timeout, "redis", self.workdir / "redis.log", self.process)
        return self

    def stop(self) -> None:
        """SIGTERM and wait: what an operator's restart does."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self.process = None

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(5)
            self.process = None

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        if down_seconds:
            time.sleep(down_seconds)
        self.start()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def url(self, db: int = 0) -> str:
        return f"redis://{LOOPBACK}:{self.port}/{db}"

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()


def session_environment(
    environ: dict[str, str],
) -> tuple[dict[str, str], list[PrivatePostgres | PrivateRedis | PrivateRabbit]]:
    """The environment a test session runs with, and the servers started for it."""
    env = dict(environ)
    started: list[PrivatePostgres | PrivateRedis | PrivateRabbit] = []
    database_url = env.get("TEST_DATABASE_URL", "")
    if not database_url:
        postgres = PrivatePostgres()
        started.append(postgres)
        postgres.start()
        database_url = postgres.create_database("relay")
    broker_url = env.get("TEST_BROKER_URL", "")
    if not broker_url:
        rabbit = PrivateRabbit("relay")
        started.append(rabbit)
        rabbit.start()
        broker_url = rabbit.url()
    state_url = env.get("TEST_STATE_URL", "")
    cache_url = env.get("TEST_CACHE_URL", "")
    if not state_url:
        redis = PrivateRedis()
        started.append(redis)
        redis.start()
        state_url = redis.url(0)
        cache_url = cache_url or redis.url(1)
    env["DATABASE_URL"] = database_url
    env["CELERY_BROKER_URL"] = broker_url
    env["RELAY_STATE_URL"] = state_url  # Redis holds state only, as in production
    if cache_url:
        env["CACHE_URL"] = cache_url
    return env, started


def main(argv: list[str]) -> int:
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    if not argv:
        print("usage: python -m tests.support.services -- COMMAND...", file=sys.stderr)
        return 2
    env, started = session_environment(dict(os.environ))
    try:
        for server in started:
            print(f"private {type(server).__name__} on port {server.port}", file=sys.stderr)
        # The command gets our signals' meaning: Ctrl-C stops it, then we clean up.
        process = subprocess.Popen(argv, env=env)
        try:
            return process.wait()
        except KeyboardInterrupt:
            process.send_signal(signal.SIGINT)
            return process.wait()
    finally:
        for server in reversed(started):
            server.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
