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


def django_on_fresh_database(name: str, *, log_level: str = "WARNING", **env: str) -> str:
    """Re-create database `name` beside DATABASE_URL's, point this process (and the ones it
    starts) at it and at CELERY_BROKER_URL, set Django up and migrate; returns its URL."""
    admin_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    broker_url = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
    database_url = prepare_database(admin_url, name)
    os.environ.update({"DATABASE_URL": database_url, "CELERY_BROKER_URL": broker_url, **env})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
    os.environ.setdefault("LOG_LEVEL", log_level)

    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return database_url


def start_fake_fcm(port: int, account: Path, *, record: bool = False) -> subprocess.Popen[bytes]:
    """The fake FCM as a process on `port` (project `bench`), its service account written to
    `account`; returns once both are there. `record`: it keeps when each request came."""
    argv = [sys.executable, "-m", "tests.fakes.fcm", "--port", str(port), "--project", "bench"]
    argv += ["--write-service-account", str(account), *(["--record"] if record else [])]
    fake = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/_fake/stats")
        while not account.exists():
            time.sleep(0.05)
    except BaseException:
        fake.kill()
        raise
    return fake


def bench_app(fcm_account: Path | None = None, fcm_url: str = "") -> Any:
    """The benchmarks' tenant, with limits above every rate offered (they measure the relay,
    not the throttle), and its app; sending to the fake FCM at `fcm_url` if given."""
    from relay.models import App, Tenant
    from relay.services.credentials import records

    tenant = Tenant.objects.create(
        name="bench", rate_limit_per_second=100_000, rate_limit_burst=100_000
    )
    app = App.objects.create(tenant=tenant, name="bench")
    if fcm_account is not None:
        credentials = {"service_account": fcm_account.read_text(), "endpoint": fcm_url}
        records.store(app, "fcm", credentials)
    return app


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


class Profiler:
    """py-spy or perf on the processes of a phase (`--profile '<py-spy or perf command>'`).

    py-spy: where their GIL time went, the collapsed stacks in
    bench/results/<name>-<process>.folded, and per process the functions holding the most
    samples (inclusive), for the JSON. perf: where ALL their CPU went, below Python too
    (bench/results/<name>-<process>.perf): the share of thread switches (waking and waiting
    for another thread, the GIL included), of the garbage collector, of the interpreter and of
    the rest of the kernel (`native_shares`)."""

    def __init__(self, command: str, pids: dict[str, int]) -> None:
        import shlex

        self.argv = shlex.split(command)
        self.perf = bool(self.argv) and Path(self.argv[0]).name == "perf"
        self.pids = pids
        self.running: list[tuple[str, Path, subprocess.Popen[bytes]]] = []

    def start(self, phase: str) -> None:
        if not self.argv:
            return
        for name, pid in self.pids.items():
            out = ROOT / "bench" / "results" / f"{phase}-{name}.{'perf' if self.perf else 'folded'}"
            out.parent.mkdir(parents=True, exist_ok=True)
            if self.perf:
                argv = [*self.argv, "record", "-F", "499", "-p", str(pid), "-o", str(out)]
            else:
                argv = [*self.argv, "record", "-p", str(pid), "-o", str(out), "-r", "250"]
                argv += ["-f", "raw", "--gil", "--nonblocking"]
            spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.running.append((name, out, spy))
        time.sleep(0.5)  # attached before the phase starts

    def stop(self, top: int = 20) -> dict[str, Any]:
        import signal

        summary: dict[str, Any] = {}
        for name, out, spy in self.running:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
            if out.exists():
                shares = (
                    native_shares(self.argv, out) if self.perf else hottest(out.read_text(), top)
                )
                if shares:  # a process that never ran in the phase (beat) has no samples
                    summary[name] = shares
        self.running.clear()
        if not summary:
            return {}
        return {"profile_native_share" if self.perf else "profile_inclusive_share": summary}


# What perf's symbols are, by their names: a thread waking another or waiting for a lock (the
# GIL's among them) and the switch itself; the cyclic garbage collector.
_SWITCH_SYMBOLS = ("finish_task_switch", "_raw_spin_unlock_irqrestore", "futex", "lll_lock_wait",
                   "__schedule", "schedule", "try_to_wake_up", "pthread_cond")  # fmt: skip
_GC_SYMBOLS = ("gc_collect", "visit_decref", "visit_reachable", "_traverse", "subtract_refs",
               "update_refs", "move_unreachable", "deduce_unreachable")  # fmt: skip


def native_shares(perf: list[str], recording: Path) -> dict[str, float]:
    """Shares of a process's CPU samples in a perf recording: thread switches, the garbage
    collector, the rest of the interpreter (libpython), the rest of the kernel, the rest."""
    report = subprocess.run(
        [*perf, "report", "-i", str(recording), "--no-children", "--sort", "dso,sym",
         "--stdio", "-g", "none"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    return shares_of_perf_report(report)


def shares_of_perf_report(report: str) -> dict[str, float]:
    """`native_shares` from the text of `perf report --sort dso,sym --stdio` (no samples: {})."""
    shares = dict.fromkeys(
        ("thread switches", "garbage collector", "interpreter", "kernel, other", "other"), 0.0
    )
    for line in report.splitlines():
        fields = line.split()
        if len(fields) < 4 or not fields[0].endswith("%") or line.lstrip().startswith("#"):
            continue
        share, dso, symbol = float(fields[0][:-1]) / 100, fields[1], fields[-1]
        if any(name in symbol for name in _SWITCH_SYMBOLS):
            key = "thread switches"
        elif any(name in symbol for name in _GC_SYMBOLS):
            key = "garbage collector"
        elif dso.startswith("libpython"):
            key = "interpreter"
        elif dso == "[kernel.kallsyms]":
            key = "kernel, other"
        else:
            key = "other"
        shares[key] += share
    if not any(shares.values()):
        return {}
    return {key: round(value, 3) for key, value in shares.items()}


OWN_CODE = ("relay/", "xmppgateway/", "pushsite/")


def hottest(folded: str, top: int) -> dict[str, float]:
    """Share of the samples (inclusive) of the relay's own functions, and of the libraries its
    deepest own frame was calling ("calls psycopg" ...): where the time goes, without the
    thread and event-loop machinery every sample holds."""
    from collections import Counter

    counts: Counter[str] = Counter()
    total = 0
    for line in folded.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        seen = set()
        library = ""
        for frame in stack.split(";"):
            function, _, where = frame.partition(" (")
            path = where.split(":")[0]
            if path.startswith(OWN_CODE):
                seen.add(f"{function} ({path})")
                library = ""
            elif seen and not library:
                library = "calls " + path.split("/")[0].removesuffix(".py")
        for key in seen | ({library} if library else set()):
            counts[key] += int(n)
        if not seen:
            counts["outside the relay's code"] += int(n)
    if not total:
        return {}
    shares = {key: round(n / total, 3) for key, n in counts.most_common(top)}
    return shares | {"samples": total}
