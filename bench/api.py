"""Windows API benchmark: device registrations per second through the HTTP API on PostgreSQL.

One registration is what a UWPX client does on first start: `set_channel_uri`, then
`set_accounts` with its accounts (two by default, as in the seed). The API runs in gunicorn as
in the Procfile, rate limits on (the per-address limit is lifted: every request comes from
loopback), counters in Redis. A second phase re-sends every device's accounts (the path that
keeps nodes and secrets). Prints and writes bench/results/api.json.

Run with `.venv/bin/python bench/api.py` (PostgreSQL and Redis on loopback; DATABASE_URL and
CELERY_BROKER_URL as for `make bench`). Options: --devices, --accounts, --concurrency,
--web-workers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import percentiles, prepare_database, wait_http, write_results  # noqa: E402

BENCH_DB = "api_bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run_phase(base_url: str, requests: list[list[dict]], concurrency: int) -> dict:
    """Each item is one device's sequence of messages, sent in order; devices run in parallel."""
    import httpx

    latencies: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    queue: asyncio.Queue[list[dict]] = asyncio.Queue()
    for sequence in requests:
        queue.put_nowait(sequence)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:

        async def device_worker() -> None:
            while True:
                try:
                    sequence = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                for message in sequence:
                    started = time.perf_counter()
                    response = await client.post(base_url, json=message)
                    latencies.setdefault(message["action"], []).append(
                        time.perf_counter() - started
                    )
                    if response.status_code != 200:
                        key = f"{message['action']}:{response.status_code}"
                        errors[key] = errors.get(key, 0) + 1
                        break

        started = time.perf_counter()
        await asyncio.gather(*(device_worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    total = sum(len(values) for values in latencies.values())
    return {
        "devices": len(requests),
        "seconds": round(elapsed, 3),
        "devices_per_second": round(len(requests) / elapsed, 1),
        "requests_per_second": round(total / elapsed, 1),
        "errors": errors,
        "latency_ms": {action: percentiles(values) for action, values in latencies.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2000)
    parser.add_argument("--accounts", type=int, default=2, help="accounts per device")
    parser.add_argument("--concurrency", type=int, default=16, help="clients in flight")
    parser.add_argument("--web-workers", type=int, default=2, help="gunicorn workers")
    args = parser.parse_args()

    admin_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    broker_url = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
    if not broker_url.startswith("redis"):
        raise SystemExit("CELERY_BROKER_URL must be redis://… (the rate-limit counters live there)")
    database_url = prepare_database(admin_url, BENCH_DB)
    os.environ.update(
        {
            "DATABASE_URL": database_url,
            "CELERY_BROKER_URL": broker_url,
            "CACHE_URL": broker_url,
            "RELAY_UWPX_RATE_LIMIT_ADDRESS": "0/60",
            "LOG_LEVEL": "WARNING",
        }
    )
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")

    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from relay.models import App, Component, Tenant

    tenant = Tenant.objects.create(name="bench")
    app = App.objects.create(tenant=tenant, name="windows")
    Component.objects.create(tenant=tenant, app=app, jid="push.bench", secret="x", port=5347)

    port = free_port()
    web = subprocess.Popen(
        [
            str(ROOT / ".venv" / "bin" / "gunicorn"),
            "pushsite.wsgi",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            str(args.web_workers),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=dict(os.environ),
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
        base_url = f"http://127.0.0.1:{port}/api/v1/apps/{app.public_key}/uwpx"

        def device(index: int, prefix: str) -> tuple[str, list[dict]]:
            device_id = f"{prefix * 4}{index:060x}"  # 64 hex characters, as UWPX sends
            accounts = [
                {"bare_jid": f"user{index}-{n}@bench{n % 7}.example"} for n in range(args.accounts)
            ]
            channel = f"https://db5p.notify.windows.com/?token=bench-{prefix}-{index}"
            return device_id, [
                {
                    "version": 1,
                    "action": "set_channel_uri",
                    "device_id": device_id,
                    "channel_uri": channel,
                },
                {
                    "version": 1,
                    "action": "set_accounts",
                    "device_id": device_id,
                    "accounts": accounts,
                },
            ]

        warm = [device(i, "a")[1] for i in range(50)]
        asyncio.run(run_phase(base_url, warm, args.concurrency))
        devices = [device(i, "b") for i in range(args.devices)]
        first = asyncio.run(run_phase(base_url, [seq for _, seq in devices], args.concurrency))
        again = asyncio.run(run_phase(base_url, [seq[1:] for _, seq in devices], args.concurrency))
    finally:
        web.terminate()
        try:
            web.wait(10)
        except subprocess.TimeoutExpired:
            web.kill()

    if first["errors"] or again["errors"]:
        raise SystemExit(f"requests failed: {first['errors']} {again['errors']}")
    results = {
        "benchmark": "api",
        "what": "UWPX registrations (set_channel_uri + set_accounts) through gunicorn",
        "registrations_per_second": first["devices_per_second"],
        "re_registrations_per_second": again["devices_per_second"],
        "accounts_per_device": args.accounts,
        "registration": first,
        "re_registration": again,
        "concurrency": args.concurrency,
        "web_workers": args.web_workers,
        "database": "postgresql",
        "cache": "redis",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    write_results("api", results)


if __name__ == "__main__":
    main()
