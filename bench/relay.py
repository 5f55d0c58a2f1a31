"""End-to-end relay benchmark: publishes over a component link, through the gateway, the
broker and the workers, to a fake FCM. Prints and writes (bench/results/relay.json):
pushes per second end to end, and p50/p95/p99 latency from publish to iq result and from
publish to the FCM request.

Run with `make bench` (PostgreSQL, RabbitMQ and Redis on loopback). Options: --pushes,
--window, --workers, --concurrency. It also reports CPU per push and the busy fraction of each
process (gateway, workers, beat, fake FCM, this client, PostgreSQL's server processes and the
broker, RabbitMQ's Erlang VM beam.smp) over
the measured run, to show which one holds throughput back. RELAY_BENCH_DB names the database
it re-creates (default relay_bench), BENCH_FAKE_PORT the fake FCM's port. `--profile
py-spy` (py-spy is in the test extra) records the gateway and the workers in every phase and
adds, per process, the share of GIL samples in the relay's own functions and in the libraries
they call (bench/results/relay-<phase>-<process>.folded holds the stacks); `--profile perf`
(Linux perf, as root) adds the share of each process's CPU spent switching threads, in the
garbage collector, in the rest of the interpreter and of the kernel.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    Profiler,
    bench_app,
    django_on_fresh_database,
    percentiles,
    start_fake_fcm,
    start_workers,
    write_results,
)
from bench.component_server import PUBLISH, ComponentServer  # noqa: E402
from tests.support.processes import beat_argv, child_pids  # noqa: E402

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


def service_cpu(pids: dict[str, int], servers: dict[str, int]) -> dict[str, float]:
    """CPU seconds of our processes plus the PostgreSQL and Redis servers this benchmark uses
    (each server's main process, its reaped children included, and its live children): other
    helpers' servers on the same machine are not counted."""
    figures = {name: cpu_seconds(pid) for name, pid in pids.items()}
    figures["bench_client"] = cpu_seconds(os.getpid())
    for name, pid in servers.items():
        figures[name] = cpu_seconds(pid) + sum(cpu_seconds(child) for child in child_pids(pid))
    return figures


def server_pids(database_url: str, broker_url: str) -> dict[str, int]:
    """The postmaster's pid (from its data directory) and the broker's: RabbitMQ's Erlang VM
    (beam.smp, the process listening on the URL's port), or the embedded broker's none."""
    import psycopg

    found: dict[str, int] = {}
    with psycopg.connect(database_url.replace("postgres://", "postgresql://")) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    if row is not None:
        found["postgres"] = int((Path(row[0]) / "postmaster.pid").read_text().split()[0])
    if broker_url.startswith(("amqp://", "pyamqp://")):
        port = urlsplit(broker_url.split(";")[0]).port or 5672
        found["broker"] = listening_pid(port)
    return found


def listening_pid(port: int) -> int:
    """The pid of the process that listens on a loopback TCP port (`ss -ltnp`)."""
    output = subprocess.run(
        ["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"pid=(\d+)", output)
    if match is None:
        raise SystemExit(f"no process found listening on port {port}")
    return int(match.group(1))


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / tick, sum(fields) / tick


class Accounting:
    """CPU of every process and of the machine between `start()` and `stop()`."""

    def __init__(self, pids: dict[str, int], servers: dict[str, int]) -> None:
        self.pids = pids
        self.servers = servers

    def start(self) -> None:
        self.before = service_cpu(self.pids, self.servers)
        self.machine_before = machine_busy()
        self.started = time.perf_counter()

    def stop(self, pushes: int) -> dict[str, object]:
        after = service_cpu(self.pids, self.servers)
        machine_after = machine_busy()
        elapsed = time.perf_counter() - self.started
        used = {name: after[name] - self.before[name] for name in after}
        relay = sum(
            v for k, v in used.items() if k in ("gateway", "beat") or k.startswith("worker_")
        )
        busy = machine_after[0] - self.machine_before[0]
        ours = sum(used.values())
        return {
            "cpu_ms_per_push": {
                name: round(value * 1000 / max(pushes, 1), 3) for name, value in used.items()
            }
            | {
                "relay_gateway_and_workers": round(relay * 1000 / max(pushes, 1), 3),
                "with_postgres_broker": round(
                    (relay + used.get("postgres", 0) + used.get("broker", 0))
                    * 1000
                    / max(pushes, 1),
                    3,
                ),
            },
            "cpu_busy_fraction": {name: round(value / elapsed, 2) for name, value in used.items()},
            "machine_busy_cores": round(busy / elapsed, 2),
            "machine_busy_cores_others": round(max(0.0, busy - ours) / elapsed, 2),
            "load_average": [round(v, 2) for v in os.getloadavg()],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pushes", type=int, default=5000)
    parser.add_argument("--window", type=int, default=256, help="publishes in flight")
    parser.add_argument("--workers", type=int, default=1, help="worker processes")
    parser.add_argument(
        "--profile",
        default="",
        help="a py-spy command (e.g. 'py-spy'): the gateway and workers are recorded in each "
        "phase (GIL samples), stacks in bench/results/relay-<phase>-<process>.folded and the "
        "hottest functions in the JSON; or a perf command ('perf'): the shares of their CPU "
        "in thread switches, the garbage collector, the interpreter and the kernel",
    )
    parser.add_argument("--concurrency", type=int, default=32, help="threads per worker")
    parser.add_argument("--gateway-threads", type=int, default=16)
    parser.add_argument(
        "--rate",
        default="100,500,1000",
        help="open-loop phases: publishes per second, comma-separated ('' for none)",
    )
    parser.add_argument("--phase-seconds", type=float, default=12.0)
    parser.add_argument(
        "--component-poll-seconds",
        default="0.5",
        help="the gateway's RELAY_COMPONENT_POLL_SECONDS, how often it runs its lease round "
        "(the product's default: 3)",
    )
    parser.add_argument("--no-closed-loop", action="store_true")
    parser.add_argument(
        "--batching",
        choices=("timer", "adaptive"),
        default="adaptive",
        help="the gateway's publish batching (adaptive: the default, no timer, one batch call "
        "at a time; timer: a 2 ms window, RELAY_PUBLISH_BATCH_SECONDS=0.002 "
        "RELAY_PUBLISH_BATCH_CONCURRENCY=0, the default before)",
    )
    args = parser.parse_args()
    rates = [int(r) for r in args.rate.split(",") if r.strip()]
    closed_pushes = 0 if args.no_closed_loop else args.pushes
    phase_sizes = [int(rate * args.phase_seconds) for rate in rates]

    database_url = django_on_fresh_database(BENCH_DB)
    broker_url = os.environ["CELERY_BROKER_URL"]
    from relay.identifiers import new_node, new_secret
    from relay.models import Component, Registration, Service
    from tests.support import broker

    broker.purge()
    workdir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    fake_port = int(os.environ.get("BENCH_FAKE_PORT", "18089"))
    fake_url = f"http://127.0.0.1:{fake_port}"
    sa_path = workdir / "sa.json"
    fake = start_fake_fcm(fake_port, sa_path, record=True)
    processes: list[subprocess.Popen[bytes]] = [fake]
    try:
        app = bench_app(sa_path, fake_url)
        tenant = app.tenant

        async def run() -> dict[str, object]:
            server = PacedComponentServer("push.bench", "bench-secret")
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
                for i in range(20 + closed_pushes + sum(phase_sizes))
            ]
            await asyncio.to_thread(
                Registration.objects.bulk_create, registrations, batch_size=2000
            )
            # As autovacuum would after a while: statistics for the lookup's plan at this size.
            await asyncio.to_thread(analyze, Registration._meta.db_table)
            env = dict(
                os.environ,
                RELAY_GATEWAY_THREADS=str(args.gateway_threads),
                RELAY_COMPONENT_POLL_SECONDS=args.component_poll_seconds,
            )
            if args.batching == "adaptive":
                env.update(RELAY_PUBLISH_BATCH_SECONDS="0", RELAY_PUBLISH_BATCH_CONCURRENCY="1")
            else:
                env.update(RELAY_PUBLISH_BATCH_SECONDS="0.002", RELAY_PUBLISH_BATCH_CONCURRENCY="0")
            processes.append(
                subprocess.Popen([sys.executable, "manage.py", "run_gateway"], cwd=ROOT, env=env)
            )
            workers = start_workers(args.workers, args.concurrency, env)
            # As in production: beat for housekeeping (a deferred send, a retry or one that
            # stepped aside for another app, is queued by the workers' own sweep).
            schedule = str(workdir / "beat-schedule")
            beat = subprocess.Popen(beat_argv(schedule, loglevel="WARNING"), cwd=ROOT, env=env)
            processes.extend([*workers, beat])
            await server.wait_connected(timeout=120)  # a loaded machine starts slowly
            # Warm up: a few pushes so connections, OAuth token and caches exist.
            warm = registrations[:20]
            await server.publish_all(
                [(f"warm-{i}", r.node, r.secret) for i, r in enumerate(warm)], window=20, timeout=60
            )
            await asyncio.to_thread(wait_fake_count, fake_url, len(warm), 60)
            server.sent_at.clear()
            server.answered_at.clear()
            pids = {"fake_fcm": fake.pid, "gateway": processes[1].pid, "beat": beat.pid}
            for number, worker in enumerate(workers):
                pids[f"worker_{number}"] = worker.pid
            accounting = Accounting(pids, server_pids(database_url, broker_url))
            profiler = Profiler(args.profile, {k: v for k, v in pids.items() if k != "fake_fcm"})
            figures: dict[str, object] = {"load_average_before": os.getloadavg()}
            sent_to_fcm = len(warm)
            offset = len(warm)
            if closed_pushes:
                batch = [
                    (f"p-{i}", r.node, r.secret)
                    for i, r in enumerate(registrations[offset : offset + closed_pushes], offset)
                ]
                offset += closed_pushes
                sent_to_fcm += len(batch)
                profiler.start("relay-closed")
                accounting.start()
                started = time.perf_counter()
                await server.publish_all(batch, window=args.window, timeout=600)
                answered = time.perf_counter()
                await asyncio.to_thread(wait_fake_count, fake_url, sent_to_fcm, 600)
                finished = time.perf_counter()
                closed: dict[str, object] = {
                    "pushes": len(batch),
                    "window": args.window,
                    "publishes_per_second_answered": round(len(batch) / (answered - started), 1),
                    "pushes_per_second_end_to_end": round(len(batch) / (finished - started), 1),
                }
                closed |= accounting.stop(len(batch))
                closed |= profiler.stop()
                closed |= await latencies(server, fake_url, batch)
                figures["closed_loop"] = closed
                report("closed loop", closed)
            open_loop = []
            for rate, size in zip(rates, phase_sizes, strict=True):
                batch = [
                    (f"p-{i}", r.node, r.secret)
                    for i, r in enumerate(registrations[offset : offset + size], offset)
                ]
                offset += size
                sent_to_fcm += len(batch)
                profiler.start(f"relay-{rate}")
                accounting.start()
                started = time.perf_counter()
                behind = await server.publish_paced(batch, rate=rate, timeout=60)
                seen = await asyncio.to_thread(
                    wait_fake_count, fake_url, sent_to_fcm, 60, strict=False
                )
                finished = time.perf_counter()
                phase: dict[str, object] = {
                    "rate_offered": rate,
                    "pushes": len(batch),
                    "not_sent_within_60s": sent_to_fcm - seen,
                    "seconds": round(finished - started, 2),
                    "generator_max_behind_ms": round(behind * 1000, 2),
                }
                phase |= accounting.stop(len(batch))
                phase |= profiler.stop()
                phase |= await latencies(server, fake_url, batch)
                open_loop.append(phase)
                report(f"open loop {rate}/s", phase)
            figures["open_loop"] = open_loop
            await server.close()
            return figures

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
            "batching": args.batching,
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


class PacedComponentServer(ComponentServer):
    """The component server with an open-loop generator besides the closed-loop one."""

    async def publish_paced(
        self, nodes: list[tuple[str, str, str]], *, rate: float, timeout: float
    ) -> float:
        """Send publish i at start + i/rate whatever the answers do; wait for every answer.
        A publish's `sent_at` is when it was due. Returns how far the generator fell behind
        its schedule at worst (seconds)."""
        assert self._writer is not None
        self._window = None
        self._expected = len(nodes)
        self._all_answered.clear()
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        behind = 0.0
        sent = 0
        while sent < len(nodes):
            now = time.perf_counter()
            due = min(len(nodes), int((now - start) * rate) + 1)
            if due > sent:
                behind = max(behind, now - (start + sent / rate))
            chunks = []
            while sent < due:
                iq_id, node, secret = nodes[sent]
                self.sent_at[iq_id] = start + sent / rate
                chunks.append(
                    PUBLISH.format(
                        domain=self.domain,
                        component=self.component_jid,
                        id=iq_id,
                        node=node,
                        secret=secret,
                    )
                )
                sent += 1
            if chunks:
                self._writer.write("".join(chunks).encode())
                await self._writer.drain()
            pause = start + sent / rate - time.perf_counter()
            if pause > 0:
                await asyncio.sleep(pause)
            else:
                await asyncio.sleep(0)
        del loop
        with contextlib.suppress(TimeoutError):  # the unanswered are counted and reported
            await asyncio.wait_for(self._all_answered.wait(), timeout)
        return behind


async def latencies(
    server: ComponentServer, fake_url: str, batch: list[tuple[str, str, str]]
) -> dict[str, object]:
    """Publish -> result and publish -> FCM request of one run's publishes; forgets them."""
    records = await asyncio.to_thread(fetch_fake_records, fake_url)
    # perf_counter -> wall clock (the fake records wall-clock times)
    shift = time.time() - time.perf_counter()
    ids = {iq_id for iq_id, _, _ in batch}
    to_fcm = []
    for record in records:
        token = str(record["token"] or "")
        if token.startswith("bench-token-"):
            iq_id = f"p-{token.rsplit('-', 1)[1]}"
            if iq_id in ids and iq_id in server.sent_at:
                to_fcm.append(float(record["time"]) - (server.sent_at[iq_id] + shift))  # type: ignore[arg-type]
    to_result = [server.answered_at[k] - server.sent_at[k] for k in ids if k in server.answered_at]
    errors = sum(1 for k in ids if server.answer_types.get(k, "result") != "result")
    unanswered = sum(1 for k in ids if k not in server.answered_at)
    for k in ids:
        server.sent_at.pop(k, None)
        server.answered_at.pop(k, None)
        server.answer_types.pop(k, None)
    return {
        "publish_errors": errors,
        "unanswered": unanswered,
        "latency_ms_publish_to_result": percentiles(to_result),
        "latency_ms_publish_to_fcm": percentiles(to_fcm),
    }


def report(name: str, figures: dict[str, object]) -> None:
    """One readable line per run while the benchmark goes on (the JSON follows at the end)."""
    cpu = figures["cpu_ms_per_push"]
    assert isinstance(cpu, dict)
    rate = figures.get("pushes_per_second_end_to_end", figures.get("rate_offered"))
    print(
        f"{name}: {rate}/s; result {figures['latency_ms_publish_to_result']}; "
        f"fcm {figures['latency_ms_publish_to_fcm']}; cpu ms/push {cpu}; "
        f"machine busy {figures['machine_busy_cores']} cores "
        f"(others {figures['machine_busy_cores_others']}); load {figures['load_average']}",
        flush=True,
    )
    for kind in ("profile_inclusive_share", "profile_native_share"):
        profiles = figures.get(kind)
        if isinstance(profiles, dict):
            for process, shares in profiles.items():
                print(f"  profile {process}: {shares}", flush=True)


def wait_fake_count(fake_url: str, count: int, timeout: float, *, strict: bool = True) -> int:
    """Wait until the fake has seen `count` sends; past the timeout raise, or (not strict)
    return how many it saw, so that a phase the relay could not keep up with still reports."""
    deadline = time.monotonic() + timeout
    while True:
        stats = json.loads(urllib.request.urlopen(f"{fake_url}/_fake/stats", timeout=5).read())
        seen = int(stats.get("sends", 0))
        if seen >= count:
            return seen
        if time.monotonic() > deadline:
            if not strict:
                return seen
            raise TimeoutError(f"fake FCM saw {seen} of {count} sends")
        time.sleep(0.05)


def fetch_fake_records(fake_url: str) -> list[dict[str, object]]:
    return json.loads(urllib.request.urlopen(f"{fake_url}/_fake/requests", timeout=30).read())


def analyze(table: str) -> None:
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f'ANALYZE "{table}"')


if __name__ == "__main__":
    main()
