"""What every benchmark needs: a fresh database, waiting for a fake, percentiles, workers."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

from tests.support.processes import worker_argv  # noqa: E402


def prepare_database(admin_url: str, name: str) -> str:
    """Drop and create database `name` next to `admin_url`'s; return its URL."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


def get_json(url: str, timeout: float = 30) -> Any:
    return json.loads(urllib.request.urlopen(url, timeout=timeout).read())


def wait_http(url: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p95/p99/mean in milliseconds of durations given in seconds."""
    if not values:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

    return {
        "p50": at(0.50),
        "p95": at(0.95),
        "p99": at(0.99),
        "mean": round(statistics.fmean(ordered) * 1000, 2),
    }


def start_workers(
    workers: int, concurrency: int, env: dict[str, str] | None = None
) -> list[subprocess.Popen[bytes]]:
    argv = worker_argv(concurrency=concurrency, loglevel="WARNING")
    return [subprocess.Popen(argv, cwd=ROOT, env=env or dict(os.environ)) for _ in range(workers)]


def write_results(name: str, results: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
