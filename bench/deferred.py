"""Deferred sends benchmark: 20,000 pushes of one tenant deferred while its provider fails,
then the provider back; every one sent, and another tenant's fresh pushes as fast as without
the backlog.

Real worker processes (Celery, threads pool), a real beat process (its sweep queues the
deferred sends, relay/services/deferred.py), PostgreSQL and the broker; two fake FCM
processes (tests/fakes/fcm.py): the `backlog` tenant's app answers 503 with Retry-After until
it is "back", the `fresh` tenant's app always answers. Publishes go in through the gateway's
service (`accept_publishes`, in this process, as the gateway calls it).

Phases, each with the fresh tenant publishing --rate pushes per second for --seconds, its
latency measured from the publish to the fake FCM's arrival:

1. baseline: no backlog;
2. outage: the backlog tenant's --backlog pushes fail and are deferred (rows, no countdowns),
   swept and refused again while the fresh tenant publishes;
3. drain: the backlog tenant's provider is back; the sweeps queue the 20,000 at a bounded
   rate while the fresh tenant publishes. Reported: how long until every backlog push is
   delivered, duplicates (sent more than once with one push id), and the CPU per push of the
   workers, beat, PostgreSQL and the broker (RabbitMQ's Erlang VM) over the phase.

Prints and writes bench/results/deferred.json, with the load average (`uptime`) before and
after. Run: `python -m tests.support.services -- .venv/bin/python bench/deferred.py`
(options: --backlog, --rate, --seconds, --workers, --concurrency, --sweep-batch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import percentiles, prepare_database, wait_http, write_results  # noqa: E402
from bench.relay import cpu_seconds, server_pids  # noqa: E402
from tests.support.processes import beat_argv, child_pids, worker_argv  # noqa: E402

BENCH_DB = os.environ.get("RELAY_BENCH_DB", "relay_bench_deferred")


class Fcm:
    """A fake FCM process and its control endpoint."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.sa_path = workdir / f"{name}-service-account.json"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.fcm", "--write-service-account", str(self.sa_path),
             "--record"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        self.url: str = json.loads(self.process.stdout.readline())["url"]
        wait_http(f"{self.url}/_fake/stats")

    def control(self, action: str, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            f"{self.url}/_fake/{action}", data=json.dumps(body).encode(), method="POST"
        )
        urllib.request.urlopen(request, timeout=30).read()

    def requests(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/_fake/requests", timeout=60) as answer:
            return list(json.loads(answer.read()))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def cpu(pids: dict[str, int], servers: dict[str, int]) -> dict[str, float]:
    figures = {name: cpu_seconds(pid) for name, pid in pids.items()}
    for name, pid in servers.items():
        figures[name] = cpu_seconds(pid) + sum(cpu_seconds(child) for child in child_pids(pid))
    return figures


class FreshPublisher:
    """The fresh tenant publishing at a steady rate; remembers when each push was accepted."""

    def __init__(self, registrations: list[Any], rate: float, seconds: float) -> None:
        self.registrations = registrations
        self.rate = rate
        self.seconds = seconds
        self.published: dict[str, float] = {}  # token -> time of acceptance
        self.refused = 0

    def run(self, phase: str) -> None:
        from relay.services.publishing import Publish, Verdict, accept_publishes

        count = int(self.rate * self.seconds)
        start = time.time()
        for n in range(count):
            pause = start + n / self.rate - time.time()
            if pause > 0:
                time.sleep(pause)
            registration = self.registrations[n % len(self.registrations)]
            [verdict] = accept_publishes([publish_for(Publish, registration, f"{phase}-{n}")])
            if verdict is Verdict.ACCEPTED:
                self.published[f"{registration.token}|{phase}-{n}"] = time.time()
            else:
                self.refused += 1


def publish_for(publish_class: Any, registration: Any, _tag: str) -> Any:
    return publish_class(
        component_id=registration.component_id,
        publishing_domain="localhost",
        node=registration.node,
        secret="secret",
        important=True,
        message_count=1,
    )


def fresh_latencies(fcm: Fcm, published: dict[str, float], since: float) -> list[float]:
    """Publish-to-arrival of each fresh push: the n-th arrival for a token after `since`
    matches the n-th acceptance for it (one token per registration, sends in order)."""
    arrivals: dict[str, list[float]] = {}
    for request in fcm.requests():
        if request["time"] >= since:
            arrivals.setdefault(request["token"], []).append(request["time"])
    accepted: dict[str, list[float]] = {}
    for key, at in sorted(published.items(), key=lambda item: item[1]):
        accepted.setdefault(key.split("|", 1)[0], []).append(at)
    latencies = []
    for token, times in accepted.items():
        for at, arrived in zip(times, sorted(arrivals.get(token, [])), strict=False):
            latencies.append(max(0.0, arrived - at))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=20000, help="pushes deferred")
    parser.add_argument("--rate", type=float, default=50.0, help="fresh pushes per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="fresh publishing per phase")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sweep-batch", type=int, default=200)
    parser.add_argument("--sweep-seconds", type=float, default=1.0)
    args = parser.parse_args()

    admin_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    broker_url = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
    os.environ.update(
        {
            "DATABASE_URL": prepare_database(admin_url, BENCH_DB),
            "CELERY_BROKER_URL": broker_url,
            "DJANGO_SETTINGS_MODULE": "pushsite.settings",
            "LOG_LEVEL": "WARNING",
            "RELAY_COALESCE_SECONDS": "0",  # one send per publish: every push counted
            # The backlog must survive the outage: attempts and age are not what is measured.
            "RELAY_SEND_MAX_ATTEMPTS": "1000",
            "RELAY_DEFERRED_SWEEP_BATCH": str(args.sweep_batch),
            "RELAY_DEFERRED_SWEEP_SECONDS": str(args.sweep_seconds),
        }
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from relay.models import App, Component, DeferredSend, Delivery, Registration, Service, Tenant
    from relay.services import throttling
    from relay.services.credentials import records
    from relay.services.publishing import Publish, Verdict, accept_publishes
    from tests.support import broker

    broker.purge()
    throttling.reset()
    workdir = Path(tempfile.mkdtemp(prefix="deferred-bench-"))
    backlog_fcm, fresh_fcm = Fcm(workdir, "backlog"), Fcm(workdir, "fresh")
    results: dict[str, Any] = {
        "benchmark": "deferred",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "options": vars(args),
        "uptime_before": uptime(),
    }
    processes: list[subprocess.Popen[bytes]] = []
    try:
        apps = {}
        for name, fcm in (("backlog", backlog_fcm), ("fresh", fresh_fcm)):
            tenant = Tenant.objects.create(name=name, rate_limit_per_second=0)
            app = App.objects.create(
                tenant=tenant,
                name=name,
            )
            records.store(
                app, "fcm", {"service_account": fcm.sa_path.read_text(), "endpoint": fcm.url}
            )
            Component.objects.create(
                tenant=tenant, app=app, jid=f"{name}.localhost", secret="s", port=5347
            )
            apps[name] = app

        def register(name: str, count: int) -> list[Registration]:
            app = apps[name]
            component = app.components.get()
            Registration.objects.bulk_create(
                [
                    Registration(
                        app=app,
                        component=component,
                        service=Service.FCM,
                        device_hash=f"{name[:1]}{n:039x}",
                        account_domain="localhost",
                        token=f"{name}-token-{n}",
                        node=f"{name}-node-{n}",
                        secret="secret",
                    )
                    for n in range(count)
                ],
                batch_size=2000,
            )
            return list(Registration.objects.filter(app=app).order_by("pk"))

        backlog_registrations = register("backlog", args.backlog)
        fresh_registrations = register("fresh", 200)

        env = dict(os.environ)
        for _ in range(args.workers):
            argv = worker_argv(concurrency=args.concurrency, loglevel="WARNING")
            processes.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL))
        beat = beat_argv(str(workdir / "beat-schedule"), loglevel="WARNING")
        processes.append(subprocess.Popen(beat, cwd=ROOT, env=env, stdout=subprocess.DEVNULL))
        pids = {f"worker_{n}": p.pid for n, p in enumerate(processes[:-1])}
        pids["beat"] = processes[-1].pid
        pids["bench_client"] = os.getpid()
        servers = server_pids(os.environ["DATABASE_URL"], broker_url)

        def phase(name: str, during: Any = None) -> dict[str, Any]:
            publisher = FreshPublisher(fresh_registrations, args.rate, args.seconds)
            since = time.time()
            before = cpu(pids, servers)
            extra: dict[str, Any] = {}
            if during is not None:
                thread = threading.Thread(target=lambda: extra.update(during()), daemon=True)
                thread.start()
            publisher.run(name)
            expected = len(publisher.published)
            deadline = time.monotonic() + 120
            while len(fresh_latencies(fresh_fcm, publisher.published, since)) < expected:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            if during is not None:
                thread.join(1800)
            used = {k: v - before[k] for k, v in cpu(pids, servers).items()}
            latencies = fresh_latencies(fresh_fcm, publisher.published, since)
            figures = {
                "fresh_published": expected,
                "fresh_refused": publisher.refused,
                "fresh_delivered": len(latencies),
                "fresh_latency_ms": percentiles(latencies),
                "cpu_seconds": {k: round(v, 2) for k, v in used.items()},
                "uptime": uptime(),
                **extra,
            }
            pushes = expected + int(extra.get("backlog_delivered", 0))
            figures["cpu_ms_per_push"] = {
                k: round(v * 1000 / max(pushes, 1), 3) for k, v in used.items()
            }
            print(f"{name}: {json.dumps(figures)}", flush=True)
            return figures

        # Warm up: the workers' provider clients and OAuth, both apps.
        for registrations in (backlog_registrations[:5], fresh_registrations[:5]):
            accept_publishes([publish_for(Publish, r, "warm") for r in registrations])
        deadline = time.monotonic() + 120
        while Delivery.objects.count() < 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        Delivery.objects.all().delete()
        backlog_fcm.control("reset", {})

        results["baseline"] = phase("baseline")

        # The outage: every send of the backlog tenant is refused (503, Retry-After 20 s).
        backlog_fcm.control("respond", {"token": None, "status": 503, "retry_after": 20})
        outage_started = time.monotonic()
        refused = 0
        for start in range(0, args.backlog, 100):
            batch = backlog_registrations[start : start + 100]
            verdicts = accept_publishes([publish_for(Publish, r, "outage") for r in batch])
            refused += sum(1 for verdict in verdicts if verdict is not Verdict.ACCEPTED)
        deadline = time.monotonic() + 600
        while DeferredSend.objects.count() < args.backlog - refused:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{DeferredSend.objects.count()} deferred")
            time.sleep(0.5)
        results["backlog"] = {
            "published": args.backlog,
            "refused": refused,
            "deferred": DeferredSend.objects.count(),
            "seconds_to_defer_all": round(time.monotonic() - outage_started, 1),
        }
        print(f"backlog: {json.dumps(results['backlog'])}", flush=True)
        results["outage"] = phase("outage")

        # The provider is back: the sweeps queue the backlog at a bounded rate.
        backlog_fcm.control("reset", {})
        back = time.monotonic()

        def drain() -> dict[str, Any]:
            deadline = time.monotonic() + 1800
            delivered = 0
            while time.monotonic() < deadline:
                delivered = Delivery.objects.filter(
                    tenant__name="backlog", outcome="delivered"
                ).count()
                if delivered >= args.backlog - refused:
                    break
                time.sleep(1.0)
            return {
                "backlog_delivered": delivered,
                "backlog_seconds_to_send_all": round(time.monotonic() - back, 1),
            }

        results["drain"] = phase("drain", drain)
        requests = backlog_fcm.requests()
        tokens = [request["token"] for request in requests]
        results["drain"]["backlog_sends_at_provider"] = len(tokens)
        results["drain"]["backlog_distinct_at_provider"] = len(set(tokens))
        results["drain"]["backlog_duplicates"] = len(tokens) - len(set(tokens))
        results["drain"]["deferred_left"] = DeferredSend.objects.count()
        results["uptime_after"] = uptime()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
        backlog_fcm.stop()
        fresh_fcm.stop()
    write_results("deferred", results)


if __name__ == "__main__":
    main()
