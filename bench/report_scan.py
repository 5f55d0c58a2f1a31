"""Where the reports' summing step spends its time in PostgreSQL: the deliveries' two
per-partition queries (analytics/sources.py: the sums by the reports' finest key, and the
latency histogram) against one query that computes both in one scan (GROUPING SETS).

Runs every day of a generated month in one backend, each variant twice (the second run is
reported), and prints the seconds, the backend's CPU seconds and the machine's load; writes
bench/results/report_scan.json. If one scan were much cheaper, the cost would be the reading
and the reports should read once; if not, it is the aggregation.

    VAR_DIR=$(mktemp -d) .venv/bin/python -m tests.support.services -- \\
        .venv/bin/python bench/report_scan.py [--rows 3000000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analytics import sources  # noqa: E402
from bench.analytics import DAYS, FIRST, SETUP, generate, machine  # noqa: E402
from bench.common import prepare_database, write_results  # noqa: E402

_LATENCY = "date_part('epoch', sent - received) * 1000"
# Both groupings of one partition's rows in one scan: the sums' key (grouping(bucket) = 1)
# and the histogram's (grouping(bucket) = 0; only delivered rows have a bucket).
ONE_SCAN = (
    "SELECT tenant_id, app_id, provider, lower(publishing_domain) AS publishing_domain, "
    "outcome, error_code, count(*) AS rows, "
    "count(*) FILTER (WHERE outcome = 'delivered') AS delivered, "
    "count(*) FILTER (WHERE outcome = 'dead_token') AS dead_tokens, "
    "count(*) FILTER (WHERE attempts > 1) AS retried, "
    "count(*) FILTER (WHERE outcome = 'failed') AS failed, bucket, "
    "count(*) FILTER (WHERE bucket IS NOT NULL) AS n, min(latency_ms) AS low, "
    "grouping(bucket) AS sums FROM ("
    "SELECT tenant_id, app_id, provider, publishing_domain, outcome, error_code, attempts, "
    f"latency_ms, CASE WHEN latency_ms IS NOT NULL THEN {sources.BUCKET_SQL} END AS bucket "
    f"FROM (SELECT *, CASE WHEN outcome = 'delivered' THEN {_LATENCY} END AS latency_ms "
    "FROM relay_delivery WHERE {where}) AS r) AS l "
    "GROUP BY GROUPING SETS ((tenant_id, app_id, provider, lower(publishing_domain), outcome, "
    "error_code), (tenant_id, app_id, provider, bucket))"
)
VARIANTS = {
    "sums": sources.DELIVERIES.sums,
    "histogram": sources.DELIVERIES.histogram,
    "one_scan": ONE_SCAN,
}


def backend_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(conn: psycopg.Connection, template: str) -> tuple[float, float, int]:
    """Seconds, backend CPU seconds and rows returned, over every day of the month."""
    pid = conn.info.backend_pid
    cpu, started, rows = backend_cpu_seconds(pid), time.monotonic(), 0
    for n in range(DAYS):
        day = FIRST + timedelta(days=n)
        where = sources._day_range(sources.DELIVERIES, day, day)
        rows += len(conn.execute(template.replace("{where}", where)).fetchall())
    return time.monotonic() - started, backend_cpu_seconds(pid) - cpu, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3_000_000)
    args = parser.parse_args()
    admin_url = os.environ.get("DATABASE_URL", "")
    if not admin_url.startswith("postgres"):
        sys.exit("run under `python -m tests.support.services --` (needs PostgreSQL)")
    url = prepare_database(admin_url, "bench_report_scan")
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "pushsite.settings",
        "VAR_DIR": tempfile.mkdtemp(prefix="bench-report-scan-"),
    }
    out = subprocess.run(
        [sys.executable, "-c", SETUP], cwd=ROOT, env=env, capture_output=True, text=True,
        check=True, timeout=300,
    ).stdout  # fmt: skip
    ids = json.loads(out.strip().splitlines()[-1])
    generate(url, ids, 1, args.rows, FIRST, DAYS)
    results: dict = {"rows": args.rows, "days": DAYS, "machine_before": machine(), "variants": {}}
    with psycopg.connect(url.replace("postgres://", "postgresql://")) as conn:
        for _ in range(2):  # the first round warms the cache; the second is reported
            for name, template in VARIANTS.items():
                seconds, cpu, rows = run(conn, template)
                results["variants"][name] = {
                    "seconds": round(seconds, 2),
                    "backend_cpu_s": round(cpu, 2),
                    "cpu_us_per_row": round(cpu * 1e6 / args.rows, 3),
                    "result_rows": rows,
                }
    results["machine_after"] = machine()
    for name, figures in results["variants"].items():
        print(f"{name:10s} {figures}")
    write_results("report_scan", results)


if __name__ == "__main__":
    main()
