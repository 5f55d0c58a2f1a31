"""End-to-end relay benchmark: publishes over a component link, through the gateway, the
broker and the workers, to a fake FCM. Prints and writes (bench/results/relay.json):
pushes per second end to end, and p50/p95/p99 latency from publish to iq result and from
publish to the FCM request.

Run with `make bench` (PostgreSQL and Redis on loopback). Options: --pushes, --window,
--workers, --concurrency. It also reports CPU per push and the busy fraction of each process
(gateway, workers, fake FCM, this client, and all PostgreSQL and Redis server processes) over
the measured run, to show which one holds throughput back. RELAY_BENCH_DB names the database
it re-creates (default relay_bench), BENCH_FAKE_PORT the fake FCM's port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import percentiles, prepare_database, start_workers, wait_http, write_results  # noqa: E402

BENCH_DB = os.environ.get("RELAY_BENCH_DB", "relay_bench")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its reaped children (prefork) so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the ")": state is field 3, so utime/stime/cutime/cstime are fields 14..17.
    ticks = sum(int(value) for value in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def service_cpu(pids: dict[str, int], names: tuple[str, ...]) -> dict[str, float]:
    """CPU seconds of our processes plus the PostgreSQL and Redis servers (by process name)."""
    figures = {name: cpu_seconds(pid) for name, pid in pids.items()}
    figures["bench_client"] = cpu_seconds(os.getpid())
    for name in names:
        total = 0.0
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    comm = (entry / "comm").read_text().strip()
                except OSError:
                    continue
                if comm.startswith(name):
                    total += cpu_seconds(int(entry.name))
        figures[name] = total
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pushes", type=int, default=5000)
    parser.add_argument("--window", type=int, default=256, help="publishes in flight")
    parser.add_argument("--workers", type=int, default=1, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="threads per worker")
    parser.add_argument("--gateway-threads", type=int, default=16)
    args = parser.parse_args()

    admin_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    broker_url = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
    database_url = prepare_database(admin_url, BENCH_DB)
    os.environ.update({"DATABASE_URL": database_url, "CELERY_BROKER_URL": broker_url})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")

    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from relay.identifiers import new_node, new_secret
    from relay.models import App, Component, Registration, Service, Tenant
    from tests.support import broker

    broker.purge()
    workdir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    fake_port = int(os.environ.get("BENCH_FAKE_PORT", "18089"))
    fake_url = f"http://127.0.0.1:{fake_port}"
    sa_path = workdir / "sa.json"
    fake = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.fakes.fcm",
            "--port",
            str(fake_port),
            "--project",
            "bench",
            "--write-service-account",
            str(sa_path),
            "--record",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    processes: list[subprocess.Popen[bytes]] = [fake]
    try:
        wait_http(f"{fake_url}/_fake/stats")
        while not sa_path.exists():
            time.sleep(0.05)
        tenant = Tenant.objects.create(name="bench")
        app = App.objects.create(
            tenant=tenant,
            name="bench",
            fcm_service_account=sa_path.read_text(),
            fcm_endpoint=fake_url,
        )

        from bench.component_server import ComponentServer

        async def run() -> dict[str, object]:
            server = ComponentServer("push.bench", "bench-secret")
            await server.start()
            component = await asyncio.to_thread(
                Component.objects.create,
                tenant=tenant,
                app=app,
                jid="push.bench",
                secret="bench-secret",
                host="127.0.0.1",
                port=server.port,
            )
            registrations = [
                Registration(
                    app=app,
                    component=component,
                    service=Service.FCM,
                    device_hash=f"{i:040x}",
                    account_domain="localhost",
                    token=f"bench-token-{i}",
                    node=new_node(),
                    secret=new_secret(),
                )
                for i in range(args.pushes)
            ]
            await asyncio.to_thread(
                Registration.objects.bulk_create, registrations, batch_size=2000
            )
            # As autovacuum would after a while: statistics for the lookup's plan at this size.
            await asyncio.to_thread(analyze, Registration._meta.db_table)
            env = dict(
                os.environ,
                RELAY_GATEWAY_THREADS=str(args.gateway_threads),
                RELAY_COMPONENT_POLL_SECONDS="0.5",
            )
            processes.append(
                subprocess.Popen([sys.executable, "manage.py", "run_gateway"], cwd=ROOT, env=env)
            )
            processes.extend(start_workers(args.workers, args.concurrency, env))
            await server.wait_connected(timeout=30)
            # Warm up: a few pushes so connections, OAuth token and caches exist.
            warm = registrations[:20]
            await server.publish_all(
                [(f"warm-{i}", r.node, r.secret) for i, r in enumerate(warm)], window=20, timeout=60
            )
            await asyncio.to_thread(wait_fake_count, fake_url, len(warm), 60)
            server.sent_at.clear()
            server.answered_at.clear()
            pids = {"fake_fcm": fake.pid, "gateway": processes[1].pid}
            for number, worker in enumerate(processes[2:]):
                pids[f"worker_{number}"] = worker.pid
            cpu_before = service_cpu(pids, ("postgres", "redis-server"))
            started_wall = time.time()
            started = time.perf_counter()
            batch = [(f"p-{i}", r.node, r.secret) for i, r in enumerate(registrations)]
            await server.publish_all(batch, window=args.window, timeout=600)
            answered = time.perf_counter()
            total_expected = len(warm) + len(batch)
            await asyncio.to_thread(wait_fake_count, fake_url, total_expected, 600)
            finished = time.perf_counter()
            cpu_after = service_cpu(pids, ("postgres", "redis-server"))
            records = fetch_fake_records(fake_url)
            await server.close()
            send_wall = {
                f"p-{i}": started_wall + (server.sent_at[f"p-{i}"] - started)
                for i in range(len(batch))
            }
            to_fcm = []
            for record in records:
                token = record["token"] or ""
                if token.startswith("bench-token-"):
                    iq_id = f"p-{token.rsplit('-', 1)[1]}"
                    if iq_id in send_wall:
                        to_fcm.append(record["time"] - send_wall[iq_id])
            to_result = [server.answered_at[k] - server.sent_at[k] for k in server.answered_at]
            errors = sum(1 for t in server.answer_types.values() if t != "result")
            return {
                "pushes": len(batch),
                "publish_errors": errors,
                "publishes_per_second_answered": round(len(batch) / (answered - started), 1),
                "pushes_per_second_end_to_end": round(len(batch) / (finished - started), 1),
                "latency_ms_publish_to_result": percentiles(to_result),
                "latency_ms_publish_to_fcm": percentiles(to_fcm),
                # CPU per push over the measured run (postgres/redis: every server process,
                # other users of the machine included).
                "cpu_ms_per_push": {
                    name: round((cpu_after[name] - cpu_before[name]) * 1000 / len(batch), 3)
                    for name in cpu_after
                },
                "cpu_busy_fraction": {
                    name: round((cpu_after[name] - cpu_before[name]) / (finished - started), 2)
                    for name in cpu_after
                },
            }

        results = asyncio.run(run())
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
    results.update(
        {
            "benchmark": "relay",
            "window": args.window,
            "workers": args.workers,
            "worker_threads": args.concurrency,
            "gateway_threads": args.gateway_threads,
            "database": "postgresql",
            "broker": broker_url.split(":", 1)[0],
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        }
    )
    write_results("relay", results)


def wait_fake_count(fake_url: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = json.loads(urllib.request.urlopen(f"{fake_url}/_fake/stats", timeout=5).read())
        if stats.get("sends", 0) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"fake FCM saw {stats.get('sends')} of {count} sends")
        time.sleep(0.05)


def fetch_fake_records(fake_url: str) -> list[dict[str, object]]:
    return json.loads(urllib.request.urlopen(f"{fake_url}/_fake/requests", timeout=30).read())


if __name__ == "__main__":
    main()


def analyze(table: str) -> None:
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f'ANALYZE "{table}"')
