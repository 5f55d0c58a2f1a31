"""Delivery-engine benchmark: sends per second per provider through the worker pool, and the
relay end to end with FCM, APNs, WNS and Web Push mixed.

Real worker processes (Celery, threads pool), Redis and PostgreSQL; the provider fakes run as
processes of their own (tests/fakes/*.py in their `python -m` mode), so the workers speak the
real wire protocols (FCM over HTTP/1.1 with OAuth, APNs over HTTP/2 with ES256 tokens, WNS
over HTTP/1.1 with OAuth, Web Push over HTTP/1.1 with VAPID and aes128gcm, which the fake
decrypts as a browser would).

- Per provider: the warm-up and measured send jobs are queued while no worker runs; then the
  workers start. The figure is measured at the fake, from the last warm-up request to the
  last measured one, so worker start-up, client construction and OAuth do not count.
- Per provider, the worker's CPU per send: its CPU time (from /proc) over the same window, so
  Celery, PostgreSQL round trips and the provider client are all in it.
- Client (`--mode client`): the provider alone, built in this process and sent to through
  `send_each` in batches as a worker's delivery does (BATCH_SLOTS at a time, --concurrency
  threads): sends per second and this process's CPU per send, which is the client library's
  cost with nothing else around it. `--fcm-latency 0.03` has the fake FCM answer 30 ms late, as
  Google would: then the provider's threads, not the CPU, bound the rate.
- Mixed: publishes over a component link (bench/component_server.py) through the gateway,
  the broker and the workers, registrations spread over the four providers; the figure is
  publishes in to sends out at the fakes.

Prints and writes bench/results/providers.json. Run with PostgreSQL and Redis on loopback:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres CELERY_BROKER_URL=redis://127.0.0.1:6379/15
.venv/bin/python bench/providers.py` (options: --sends, --pushes, --workers, --concurrency,
--mode providers|client|mixed|all). Every run records the load average before and after.
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
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    get_json,
    percentiles,
    prepare_database,
    start_workers,
    wait_http,
    write_results,
)
from bench.relay import cpu_seconds  # noqa: E402

BENCH_DB = "relay_bench_providers"
WARMUP = 64
SERVICES = ("fcm", "apns", "wns", "webpush")


class Fakes:
    """The provider fakes as processes, and how to read their counts."""

    def __init__(self, workdir: Path) -> None:
        self.processes: list[subprocess.Popen[str]] = []
        self.sa_path = workdir / "service-account.json"
        self.key_path = workdir / "apns.p8"
        fcm = self._start(
            ["tests.fakes.fcm", "--write-service-account", str(self.sa_path), "--record"]
        )
        self.fcm_url: str = fcm["url"]
        self.apns = self._start(["tests.fakes.apns", "--write-key", str(self.key_path)])
        self.wns = self._start(["tests.fakes.wns"])
        self.webpush = self._start(["tests.fakes.webpush"])
        self._webpush_tokens: list[str] = []
        wait_http(f"{self.fcm_url}/_fake/stats")

    def _start(self, argv: list[str]) -> dict[str, Any]:
        process = subprocess.Popen(
            [sys.executable, "-m", *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.processes.append(process)
        assert process.stdout is not None
        return json.loads(process.stdout.readline())

    def times(self, service: str) -> list[float]:
        """Arrival time of every send request so far, sorted."""
        if service == "fcm":
            return sorted(r["time"] for r in get_json(f"{self.fcm_url}/_fake/requests"))
        if service == "apns":
            return get_json(self.apns["control"])["times"]
        if service == "webpush":
            return get_json(f"{self.webpush['origin']}/_fake/stats")["times"]
        return get_json(f"{self.wns['base_url']}/_fake/stats")["times"]

    def count(self, service: str) -> int:
        if service == "fcm":
            return int(get_json(f"{self.fcm_url}/_fake/stats")["sends"])
        if service == "apns":
            return int(get_json(self.apns["control"])["sends"])
        if service == "webpush":
            return int(get_json(f"{self.webpush['origin']}/_fake/stats")["sends"])
        return int(get_json(f"{self.wns['base_url']}/_fake/stats")["sends"])

    def webpush_token(self) -> str:
        """A new subscription's token (the fake keeps its private key to decrypt with)."""
        if not self._webpush_tokens:
            request = urllib.request.Request(
                f"{self.webpush['origin']}/_fake/subscribe",
                data=json.dumps({"count": 500}).encode(),
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=60) as answer:
                self._webpush_tokens = json.loads(answer.read())
        return self._webpush_tokens.pop()

    def wait_for(self, service: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.count(service) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service}: {self.count(service)} of {count} sends")
            time.sleep(0.05)

    def fcm_control(self, action: str, body: dict[str, Any]) -> None:
        """Script the fake FCM (`respond`, `reset`) over its control endpoint."""
        request = urllib.request.Request(
            f"{self.fcm_url}/_fake/{action}", data=json.dumps(body).encode(), method="POST"
        )
        urllib.request.urlopen(request, timeout=30).read()

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def stop_all(processes: list[subprocess.Popen[Any]]) -> None:
    for process in reversed(processes):
        process.terminate()
    for process in processes:
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()


def token_for(service: str, fakes: Fakes, n: int, run: str) -> str:
    if service == "fcm":
        return f"bench-{run}-{n}"
    if service == "apns":
        return uuid.uuid4().hex * 2
    if service == "webpush":
        return fakes.webpush_token()
    return f"{fakes.wns['base_url']}/channel/{run}{n}?token=bench"


def make_registrations(component: Any, service: str, fakes: Fakes, count: int, run: str) -> list:
    from relay.identifiers import new_node, new_secret
    from relay.models import Registration

    registrations = [
        Registration(
            app=component.app,
            component=component,
            service=service,
            device_hash=uuid.uuid4().hex + f"{n:08x}",
            account_domain="localhost",
            token=token_for(service, fakes, n, run),
            node=new_node(),
            secret=new_secret(),
        )
        for n in range(count)
    ]
    return Registration.objects.bulk_create(registrations, batch_size=2000)


def bench_provider(
    service: str, component: Any, fakes: Fakes, args: argparse.Namespace
) -> dict[str, Any]:
    from django.db.models import Count
    from django.utils import timezone

    from relay import conf
    from relay.models import Delivery
    from relay.services import queue

    registrations = make_registrations(component, service, fakes, WARMUP + args.sends, service)
    before = fakes.count(service)
    now = timezone.now().isoformat()
    jobs = [
        queue.SendJob(
            push_id=str(uuid.uuid4()),
            registration_id=registration.pk,
            publishing_domain="localhost",
            important=True,
            received=now,
        )
        for registration in registrations
    ]
    # As the gateway queues them: batches of up to RELAY PUBLISH_BATCH_MAX jobs per message, or
    # one message per job with --single (the path of retries, replays and test pushes).
    batch_max = conf.current().publish_batch_max
    size = 1 if args.single else batch_max
    for start in range(0, len(jobs), size):
        queue.enqueue_sends(jobs[start : start + size])
    workers = start_workers(args.workers, args.concurrency)

    def sample() -> tuple[int, float]:
        return fakes.count(service), sum(cpu_seconds(worker.pid) for worker in workers)

    try:
        fakes.wait_for(service, before + WARMUP, timeout=600)
        warm_sends, warm_cpu = sample()
        fakes.wait_for(service, before + len(registrations), timeout=600)
        last_sends, last_cpu = sample()
    finally:
        stop_all(workers)
    times = fakes.times(service)[before:]
    start, end = times[WARMUP - 1], times[-1]
    outcomes = dict(
        Delivery.objects.filter(provider=service).values_list("outcome").annotate(n=Count("id"))
    )
    return {
        "sends": args.sends,
        "sends_per_second": round(args.sends / (end - start), 1),
        "worker_cpu_ms_per_send": round(
            (last_cpu - warm_cpu) * 1000 / max(1, last_sends - warm_sends), 3
        ),
        "jobs_per_message": 1 if args.single else batch_max,
        "outcomes": outcomes,
    }


def client_for(service: str, fakes: Fakes) -> Any:
    """The provider as the registry builds it for the bench app, in this process."""
    from relay.providers.apns import ApnsConfig, ApnsProvider
    from relay.providers.fcm import FcmConfig, FcmProvider
    from relay.providers.webpush import WebPushConfig, WebPushProvider, new_private_key
    from relay.providers.wns import WnsConfig, WnsProvider

    if service == "fcm":
        return FcmProvider(FcmConfig.parse(fakes.sa_path.read_text(), fakes.fcm_url))
    if service == "apns":
        info = fakes.apns
        config = ApnsConfig(
            topic=info["topic"],
            key=fakes.key_path.read_text(),
            key_id=info["key_id"],
            team_id=info["team_id"],
            endpoint=info["endpoint"],
            ca_file=info["ca_file"],
        )
        return ApnsProvider(config)
    if service == "webpush":
        return WebPushProvider(
            WebPushConfig(
                private_key=new_private_key(),
                subject="mailto:bench@example.org",
                endpoint_hosts=(fakes.webpush["host_pattern"],),
            )
        )
    if service == "wns":
        info = fakes.wns
        return WnsProvider(
            WnsConfig(
                package_sid=info["client_id"],
                secret=info["client_secret"],
                token_url=info["token_url"],
                channel_hosts=(info["host_pattern"],),
            )
        )
    raise ValueError(f"no client benchmark for {service}")


def bench_client(service: str, fakes: Fakes, args: argparse.Namespace) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial

    from relay.providers.base import Outcome, Wakeup, send_each
    from relay.services.provider_limits import BATCH_SLOTS

    def batches(count: int, run: str) -> list[list[Wakeup]]:
        wakeups = [
            Wakeup(
                push_id=str(uuid.uuid4()),
                token=token_for(service, fakes, n, run),
                account=uuid.uuid4().hex + "0" * 8,
                important=True,
            )
            for n in range(count)
        ]
        return [wakeups[i : i + BATCH_SLOTS] for i in range(0, count, BATCH_SLOTS)]

    provider = client_for(service, fakes)
    warm, measured = batches(WARMUP * 4, f"cw{service}"), batches(args.sends, f"c{service}")
    latency = args.fcm_latency if service == "fcm" else 0.0
    if latency:  # every send answered that much later, as from Google
        fakes.fcm_control("respond", {"token": None, "delay": latency})
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(partial(send_each, provider), warm))
            cpu, started = time.process_time(), time.perf_counter()
            results = [r for rs in pool.map(partial(send_each, provider), measured) for r in rs]
            cpu, elapsed = time.process_time() - cpu, time.perf_counter() - started
    finally:
        provider.close()
        if latency:
            fakes.fcm_control("reset", {})
    delivered = sum(1 for r in results if r.outcome == Outcome.DELIVERED)
    return {
        "sends": len(results),
        "delivered": delivered,
        "sends_per_second": round(len(results) / elapsed, 1),
        "client_cpu_ms_per_send": round(cpu * 1000 / len(results), 3),
        "threads": args.concurrency,
        "batch": BATCH_SLOTS,
        "answer_delay_seconds": latency,
    }


def bench_mixed(component: Any, fakes: Fakes, args: argparse.Namespace) -> dict[str, Any]:
    from bench.component_server import ComponentServer
    from relay.models import Component

    shares = len(SERVICES)
    per_service = {
        s: args.pushes // shares + (1 if i < args.pushes % shares else 0)
        for i, s in enumerate(SERVICES)
    }
    warm = {s: make_registrations(component, s, fakes, 10, f"mixwarm{s}") for s in SERVICES}
    measured = {
        s: make_registrations(component, s, fakes, per_service[s], f"mix{s}") for s in SERVICES
    }
    before = {s: fakes.count(s) for s in SERVICES}
    processes: list[subprocess.Popen[bytes]] = []

    async def run() -> dict[str, Any]:
        server = ComponentServer("push.bench", "bench-secret")
        await server.start()
        await asyncio.to_thread(
            Component.objects.filter(pk=component.pk).update,
            jid="push.bench",
            secret="bench-secret",
            host="127.0.0.1",
            port=server.port,
            enabled=True,
        )
        env = dict(
            os.environ,
            RELAY_GATEWAY_THREADS=str(args.gateway_threads),
            RELAY_COMPONENT_POLL_SECONDS="0.5",
        )
        processes.append(
            subprocess.Popen([sys.executable, "manage.py", "run_gateway"], cwd=ROOT, env=env)
        )
        processes.extend(start_workers(args.workers, args.concurrency))
        await server.wait_connected(timeout=30)
        warm_batch = [
            (f"warm-{s}-{i}", r.node, r.secret) for s in SERVICES for i, r in enumerate(warm[s])
        ]
        await server.publish_all(warm_batch, window=30, timeout=60)
        for s in SERVICES:
            await asyncio.to_thread(fakes.wait_for, s, before[s] + len(warm[s]), 60)
        server.sent_at.clear()
        server.answered_at.clear()
        # Interleave the providers, as real traffic would.
        batch = []
        for i in range(max(per_service.values())):
            for s in SERVICES:
                if i < len(measured[s]):
                    r = measured[s][i]
                    batch.append((f"p-{s}-{i}", r.node, r.secret))
        started = time.perf_counter()
        await server.publish_all(batch, window=args.window, timeout=600)
        answered = time.perf_counter()
        for s in SERVICES:
            target = before[s] + len(warm[s]) + len(measured[s])
            await asyncio.to_thread(fakes.wait_for, s, target, 600)
        finished = time.perf_counter()
        errors = sum(1 for t in server.answer_types.values() if t != "result")
        to_result = [server.answered_at[k] - server.sent_at[k] for k in server.answered_at]
        await server.close()
        return {
            "pushes": len(batch),
            "per_provider": per_service,
            "publish_errors": errors,
            "publishes_per_second_answered": round(len(batch) / (answered - started), 1),
            "pushes_per_second_end_to_end": round(len(batch) / (finished - started), 1),
            "latency_ms_publish_to_result": percentiles(to_result),
        }

    try:
        return asyncio.run(run())
    finally:
        stop_all(processes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--single", action="store_true", help="one job per broker message (default: batches)"
    )
    parser.add_argument("--sends", type=int, default=3000, help="measured sends per provider")
    parser.add_argument("--pushes", type=int, default=3000, help="publishes in the mixed run")
    parser.add_argument("--window", type=int, default=256, help="publishes in flight (mixed)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=32, help="threads per worker")
    parser.add_argument("--gateway-threads", type=int, default=16)
    parser.add_argument("--mode", choices=["providers", "client", "mixed", "all"], default="all")
    parser.add_argument("--providers", default=",".join(SERVICES))
    parser.add_argument(
        "--fcm-latency",
        type=float,
        default=0.0,
        help="client mode: seconds the fake FCM holds each answer (Google's round trip)",
    )
    args = parser.parse_args()

    admin_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    broker_url = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
    os.environ.update(
        {"DATABASE_URL": prepare_database(admin_url, BENCH_DB), "CELERY_BROKER_URL": broker_url}
    )
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    # Measure the engine, not the coalescing window or a tenant's rate limit.
    os.environ.setdefault("RELAY_COALESCE_SECONDS", "0")

    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from relay.models import App, Component, Tenant
    from relay.providers.webpush import new_private_key
    from relay.services import throttling
    from relay.services.credentials import records
    from tests.support import broker

    broker.purge()
    throttling.reset()
    workdir = Path(tempfile.mkdtemp(prefix="providers-bench-"))
    fakes = Fakes(workdir)
    results: dict[str, Any] = {"benchmark": "providers"}
    load_before = os.getloadavg()
    try:
        tenant = Tenant.objects.create(name="bench", rate_limit_per_second=0)
        app = App.objects.create(tenant=tenant, name="bench")
        records.store(
            app, "fcm", {"service_account": fakes.sa_path.read_text(), "endpoint": fakes.fcm_url}
        )
        records.store(
            app,
            "apns",
            {
                "topic": fakes.apns["topic"],
                "key": fakes.key_path.read_text(),
                "key_id": fakes.apns["key_id"],
                "team_id": fakes.apns["team_id"],
                "endpoint": fakes.apns["endpoint"],
                "ca_certificate": Path(fakes.apns["ca_file"]).read_text(),
            },
        )
        records.store(
            app,
            "wns",
            {
                "package_sid": fakes.wns["client_id"],
                "secret": fakes.wns["client_secret"],
                "token_url": fakes.wns["token_url"],
                "channel_hosts": fakes.wns["host_pattern"],
            },
        )
        records.store(
            app,
            "webpush",
            {
                "private_key": new_private_key(),
                "subject": "mailto:bench@example.org",
                "endpoint_hosts": fakes.webpush["host_pattern"],
            },
        )
        component = Component.objects.create(
            tenant=tenant,
            app=app,
            jid="push.bench",
            secret="bench-secret",
            enabled=False,  # the mixed run points it at its component server
        )
        if args.mode in ("providers", "all"):
            results["per_provider"] = {
                service: bench_provider(service, component, fakes, args)
                for service in args.providers.split(",")
            }
        if args.mode in ("client", "all"):
            results["client"] = {
                service: bench_client(service, fakes, args)
                for service in args.providers.split(",")
            }
        if args.mode in ("mixed", "all"):
            results["mixed"] = bench_mixed(component, fakes, args)
    finally:
        fakes.stop()
    results.update(
        {
            "workers": args.workers,
            "worker_threads": args.concurrency,
            "database": "postgresql",
            "broker": broker_url.split(":", 1)[0],
            "cpus": os.cpu_count(),
            "load_average": [round(v, 2) for v in (*load_before, *os.getloadavg())],
            "python": platform.python_version(),
        }
    )
    write_results("providers", results)


if __name__ == "__main__":
    main()
