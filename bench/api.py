"""Windows API benchmark: device registrations per second through the HTTP API on PostgreSQL.

One registration is what a UWPX client does on first start: `set_channel_uri`, then
`set_accounts` with its accounts (two by default, as in the seed). The API runs in the web
process as the Procfile starts it (`python -m pushsite.server`), rate limits on (the per-address
limit is lifted: every request comes from loopback), counters in Redis. A second phase
re-sends every device's accounts (the path that keeps nodes and secrets).

Figures per phase: devices and requests per second, latency per action, and the CPU each
process spent per device (the web's workers, this driver, PostgreSQL's and Redis's server
processes, found by the ports they serve, so other servers on the machine are not counted),
with the machine's load average and busy fraction: the machine is shared, so a rate alone
says little. The driver is a minimal HTTP/1.1 keep-alive client on asyncio (a general client
would cost more CPU than the server it measures). Prints and writes bench/results/api.json.

Run with `.venv/bin/python -m tests.support.services -- .venv/bin/python bench/api.py`
(or DATABASE_URL and CELERY_BROKER_URL pointing at PostgreSQL and Redis). Options: --devices,
--accounts, --concurrency, --web-workers, --web-threads, --reconnect (a new connection per
device, as Windows clients connect), --profile (a py-spy command: each
worker is recorded in each phase, collapsed stacks in bench/results/api-*.folded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import percentiles, prepare_database, wait_http, write_results  # noqa: E402

BENCH_DB = "api_bench"
OK = re.compile(rb'"status": ?1')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- CPU accounting from /proc --------------------------------------------------------------------


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """User + system CPU of a process (and of its children it reaped, when `children`)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the ")": state is field 3, so utime/stime/cutime/cstime are fields 14..17.
    ticks = sum(int(value) for value in fields[11 : 15 if children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


def child_pids(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent:
                found.append(int(entry.name))
    return found


def tree_cpu(root: int) -> float:
    """A server and its live children: the postmaster's backends, the web's workers."""
    return cpu_seconds(root) + sum(cpu_seconds(pid) for pid in child_pids(root))


def postgres_pid(database_url: str) -> int:
    import psycopg

    with psycopg.connect(database_url) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    assert row is not None
    return int(Path(row[0], "postmaster.pid").read_text().split()[0])


def redis_pid(redis_url: str) -> int:
    import redis

    return int(redis.Redis.from_url(redis_url).info("server")["process_id"])


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs so far, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return float(sum(values) - idle), float(sum(values))


# --- the driver: HTTP/1.1 keep-alive over asyncio streams ------------------------------------


class Connection:
    """One keep-alive connection; reconnects when the server closes it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        for attempt in range(2):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None
            self.writer.write(
                b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s"
                % (path.encode(), self.host.encode(), len(body), body)
            )
            try:
                head = await self.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                self.close()
                if attempt:
                    raise
                continue  # the server closed a kept-alive connection: send again
            lines = head.split(b"\r\n")
            status = int(lines[0].split()[1])
            length, close = 0, False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
            answer = await self.reader.readexactly(length)
            if close:
                self.close()
            return status, answer
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def run_phase(
    base_url: str, requests: list[list[dict]], concurrency: int, *, reconnect: bool = False
) -> dict:
    """Each item is one device's sequence of messages, sent in order; devices run in parallel.

    `reconnect`: each device on a connection of its own, as Windows clients connect: kept-alive
    connections stay with the web worker that accepted them, and 32 of them can all land
    on one worker (its GIL then bounds the run while the other idles)."""
    split = urlsplit(base_url)
    host, port, path = split.hostname or "127.0.0.1", split.port or 80, split.path
    latencies: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    todo = iter([[(m["action"], json.dumps(m).encode()) for m in seq] for seq in requests])

    async def device_worker() -> None:
        connection = Connection(host, port)
        try:
            for sequence in todo:
                for action, body in sequence:
                    started = time.perf_counter()
                    status, answer = await connection.post(path, body)
                    latencies.setdefault(action, []).append(time.perf_counter() - started)
                    if status != 200 or not OK.search(answer):
                        key = f"{action}:{status}"
                        errors[key] = errors.get(key, 0) + 1
                        if len(errors) == 1 and errors[key] == 1:
                            print(f"first error: {status} {answer[:300]!r}", file=sys.stderr)
                        break
                if reconnect:
                    connection.close()
        finally:
            connection.close()

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


def measured(
    name: str,
    base_url: str,
    requests: list[list[dict]],
    concurrency: int,
    pids: dict[str, int],
    profile: str,
    reconnect: bool = False,
) -> dict:
    """One phase with the CPU of every process and the machine's load around it."""
    web_workers = child_pids(pids["web"])

    def snapshot() -> dict[str, float]:
        figures = {f"web_worker_{n}": cpu_seconds(pid) for n, pid in enumerate(web_workers)}
        figures["web_master"] = cpu_seconds(pids["web"], children=False)
        figures["postgres"] = tree_cpu(pids["postgres"])
        figures["redis"] = cpu_seconds(pids["redis"])
        figures["driver"] = cpu_seconds(os.getpid(), children=False)
        return figures

    spies = []
    if profile:
        for pid in web_workers:
            out = ROOT / "bench" / "results" / f"api-{name}-{pid}.folded"
            out.parent.mkdir(parents=True, exist_ok=True)
            argv = [
                *shlex.split(profile),
                "record",
                "-p",
                str(pid),
                "-o",
                str(out),
                "-r",
                "200",
                "-f",
                "raw",
                "--gil",
            ]
            spies.append(subprocess.Popen([*argv, "--nonblocking"], stdout=subprocess.DEVNULL))
        time.sleep(1.0)
    load_before = os.getloadavg()
    busy_before = machine_busy()
    before = snapshot()
    result = asyncio.run(run_phase(base_url, requests, concurrency, reconnect=reconnect))
    after = snapshot()
    busy_after = machine_busy()
    for spy in spies:
        spy.send_signal(2)
        spy.wait(30)
    devices = max(1, result["devices"])
    cpu_ms = {key: round((after[key] - before[key]) * 1000 / devices, 3) for key in after}
    cpu_ms["web"] = round(sum(v for k, v in cpu_ms.items() if k.startswith("web_")), 3)
    cpu_ms["server_total"] = round(cpu_ms["web"] + cpu_ms["postgres"] + cpu_ms["redis"], 3)
    result["cpu_ms_per_device"] = cpu_ms
    result["load_average"] = [round(v, 2) for v in (*load_before, *os.getloadavg())]
    result["machine_busy_fraction"] = round(
        (busy_after[0] - busy_before[0]) / max(1.0, busy_after[1] - busy_before[1]), 3
    )
    print(
        f"{name}: {result['devices_per_second']} devices/s "
        f"({result['requests_per_second']} requests/s), CPU ms per device: "
        + ", ".join(f"{k} {v}" for k, v in cpu_ms.items() if not k.startswith("web_w"))
        + f"; load {result['load_average'][:3]} -> {result['load_average'][3:]}, "
        f"machine busy {result['machine_busy_fraction']}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=4000)
    parser.add_argument("--accounts", type=int, default=2, help="accounts per device")
    parser.add_argument("--concurrency", type=int, default=32, help="clients in flight")
    parser.add_argument("--web-workers", type=int, default=2, help="web worker processes")
    parser.add_argument("--web-threads", type=int, default=16, help="threads per worker")
    parser.add_argument("--profile", default="", help="py-spy command to record workers with")
    parser.add_argument(
        "--reconnect",
        action="store_true",
        help="a new connection per device (as Windows clients), not one kept per client slot",
    )
    args = parser.parse_args()

    admin_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    broker_url = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
    cache_url = os.environ.get("CACHE_URL", "redis://127.0.0.1:6379/15")
    if not cache_url.startswith("redis"):
        raise SystemExit("CACHE_URL must be redis://… (the rate-limit counters live there)")
    database_url = prepare_database(admin_url, BENCH_DB)
    os.environ.update(
        {
            "DATABASE_URL": database_url,
            "CELERY_BROKER_URL": broker_url,
            "CACHE_URL": cache_url,
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
        [sys.executable, "-m", "pushsite.server"],
        cwd=ROOT,
        env={
            **os.environ,
            "WEB_BIND": f"127.0.0.1:{port}",
            "WEB_WORKERS": str(args.web_workers),
            "WEB_THREADS": str(args.web_threads),
        },
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
        pids = {
            "web": web.pid,
            "postgres": postgres_pid(database_url),
            "redis": redis_pid(os.environ["CACHE_URL"]),
        }
        base_url = f"http://127.0.0.1:{port}/api/v1/apps/{app.public_key}/uwpx"

        def device(index: int, prefix: str) -> list[dict]:
            device_id = f"{prefix * 4}{index:060x}"  # 64 hex characters, as UWPX sends
            accounts = [
                {"bare_jid": f"user{index}-{n}@bench{n % 7}.example"} for n in range(args.accounts)
            ]
            channel = f"https://db5p.notify.windows.com/?token=bench-{prefix}-{index}"
            return [
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

        warm = [device(i, "a") for i in range(200)]
        asyncio.run(run_phase(base_url, warm, args.concurrency))
        asyncio.run(run_phase(base_url, [seq[1:] for seq in warm], args.concurrency))
        devices = [device(i, "b") for i in range(args.devices)]
        first = measured(
            "registration",
            base_url,
            devices,
            args.concurrency,
            pids,
            args.profile,
            args.reconnect,
        )
        again = measured(
            "re_registration",
            base_url,
            [seq[1:] for seq in devices],
            args.concurrency,
            pids,
            args.profile,
            args.reconnect,
        )
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
        "what": "UWPX registrations (set_channel_uri + set_accounts) through the web process",
        "registrations_per_second": first["devices_per_second"],
        "re_registrations_per_second": again["devices_per_second"],
        "accounts_per_device": args.accounts,
        "registration": first,
        "re_registration": again,
        "concurrency": args.concurrency,
        "reconnect": args.reconnect,
        "web_workers": args.web_workers,
        "web_threads": args.web_threads,
        "database": "postgresql",
        "cache": "redis",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    write_results("api", results)


if __name__ == "__main__":
    main()
