"""The gateway's everyday path without the gateway around it: one publish planned
(`publishing.plan_publishes`: the lookup, the throttle) and sent (`direct_sends.send_planned`:
the FCM request, the bookkeeping), one after the other in one thread, against the real
PostgreSQL, Redis and a fake FCM behind the real client.

Prints and writes (bench/results/everyday_path.json) the thread's CPU per push for planning
and for sending, its user and system time and its context switches, for each gap between
pushes: none (back to back), a sleep (as at an everyday rate, where the process is idle
between pushes) and a busy wait of the same length (the thread kept running). What the code
costs apart from the event loop and the threads around it, and how much more it costs when
it runs cold. Options: --pushes, --gap (seconds), --profile, --journal (seconds).
RELAY_BENCH_DB names the database it re-creates (default relay_everyday), BENCH_FAKE_PORT the
fake FCM's port.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    bench_app,
    django_on_fresh_database,
    start_fake_fcm,
    write_results,
)

WARM_PUSHES = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=500, help="pushes per way of pacing")
    parser.add_argument("--gap", type=float, default=0.01, help="seconds between pushes")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile the pushes paced by sleeps (cProfile on the thread's CPU time) and "
        "print the share of the relay's main steps",
    )
    parser.add_argument(
        "--journal",
        type=float,
        default=0.0,
        help="send with a delivery journal written this often (seconds), as the gateway "
        "does by default (RELAY_DELIVERY_JOURNAL_SECONDS); 0: each push's rows written "
        "before its answer",
    )
    args = parser.parse_args()
    django_on_fresh_database(os.environ.get("RELAY_BENCH_DB", "relay_everyday"))

    from relay.identifiers import new_node, new_secret
    from relay.models import Component, Registration, Service
    from relay.services import direct_sends, publishing
    from relay.services.delivery_journal import Journal

    port = int(os.environ.get("BENCH_FAKE_PORT", "18091"))
    account = Path(tempfile.mkdtemp(prefix="relay-bench-")) / "sa.json"
    fake = start_fake_fcm(port, account)
    journal = None
    if args.journal > 0:
        journal = Journal(Path(tempfile.mkdtemp(prefix="relay-journal-")), interval=args.journal)
        journal.start()
    try:
        app = bench_app(account, f"http://127.0.0.1:{port}")
        tenant = app.tenant
        component = Component.objects.create(
            tenant=tenant, app=app, jid="push.bench", secret="s", host="127.0.0.1", port=1
        )
        paces = ["back to back", "sleep", "busy wait"]
        registrations = Registration.objects.bulk_create(
            Registration(
                app=app,
                component=component,
                service=Service.FCM,
                device_hash=f"{n:040x}",
                account_domain="localhost",
                token=f"bench-token-{n}",
                node=new_node(),
                secret=new_secret(),
            )
            for n in range(WARM_PUSHES + args.pushes * (len(paces) + args.profile))
        )

        def push(registration: Registration) -> tuple[float, float]:
            publish = publishing.Publish(
                component_id=component.pk,
                publishing_domain="localhost",
                node=registration.node,
                secret=registration.secret,
                important=True,
            )
            started = time.thread_time()
            plan = publishing.plan_publishes([publish], claim=lambda app, jobs: jobs)
            planned = time.thread_time()
            [send] = plan.direct
            verdicts = direct_sends.send_planned(plan, send, journal)
            sent = time.thread_time()
            if verdicts != [publishing.Verdict.ACCEPTED]:
                raise RuntimeError(f"a push was not accepted: {verdicts}")
            return planned - started, sent - planned

        for registration in registrations[:WARM_PUSHES]:  # connections, token, caches
            push(registration)
        figures: dict[str, Any] = {"load_average_before": os.getloadavg()}
        phases = []
        for number, pace in enumerate(paces):
            start = WARM_PUSHES + number * args.pushes
            plan_cpu = send_cpu = 0.0
            before = resource.getrusage(resource.RUSAGE_THREAD)
            process_before = time.process_time()
            journal_before = journal.cpu_seconds if journal else 0.0
            for registration in registrations[start : start + args.pushes]:
                planning, sending = push(registration)
                plan_cpu += planning
                send_cpu += sending
                if pace == "sleep":
                    time.sleep(args.gap)
                elif pace == "busy wait":
                    until = time.perf_counter() + args.gap
                    while time.perf_counter() < until:
                        pass
            if journal is not None:  # this phase's rows written by its thread, not the next's
                time.sleep(journal.interval * 3)
            after = resource.getrusage(resource.RUSAGE_THREAD)
            process_cpu = time.process_time() - process_before
            n = args.pushes
            phase = {
                "pace": pace,
                "gap_seconds": 0.0 if pace == "back to back" else args.gap,
                "pushes": n,
                "cpu_ms_per_push": {
                    "plan": round(plan_cpu / n * 1000, 3),
                    "send": round(send_cpu / n * 1000, 3),
                    "both": round((plan_cpu + send_cpu) / n * 1000, 3),
                },
                # Every thread of the process (the journal's too), the busy wait included.
                "process_cpu_ms_per_push": round(process_cpu / n * 1000, 3),
                "journal_thread_cpu_ms_per_push": round(
                    ((journal.cpu_seconds if journal else 0.0) - journal_before) / n * 1000, 3
                ),
                # The busy wait's own time is in the thread's user time, not in plan or send.
                "thread_user_sys_ms_per_push": [
                    round((after.ru_utime - before.ru_utime) / n * 1000, 3),
                    round((after.ru_stime - before.ru_stime) / n * 1000, 3),
                ],
                "context_switches_per_push": {
                    "voluntary": round((after.ru_nvcsw - before.ru_nvcsw) / n, 2),
                    "involuntary": round((after.ru_nivcsw - before.ru_nivcsw) / n, 2),
                },
                "load_average": os.getloadavg(),
            }
            cpu = phase["cpu_ms_per_push"]
            print(
                f"{pace}: plan {cpu['plan']} ms, send {cpu['send']} ms, "
                f"both {cpu['both']} ms of the thread's CPU per push; the process's "
                f"{phase['process_cpu_ms_per_push']} ms (the journal's thread "
                f"{phase['journal_thread_cpu_ms_per_push']} ms); load {phase['load_average']}"
            )
            phases.append(phase)
        figures |= {
            "benchmark": "everyday_path",
            "journal_seconds": args.journal,
            "phases": phases,
            "cpus": os.cpu_count(),
        }
        if args.profile:
            start = WARM_PUSHES + len(paces) * args.pushes
            figures["profile"] = profile(push, registrations[start:], args.gap)
            print(f"profile, share of the thread's CPU: {figures['profile']}")
        write_results("everyday_path", figures)
    finally:
        if journal is not None:
            journal.stop()
        fake.kill()
        fake.wait()


# The steps whose share of a push's CPU the profile reports (inclusive).
STEPS = {
    "FCM request": ("relay/providers/fcm/__init__.py", "send"),
    "registration lookup": ("relay/services/publishing.py", "_find_registrations"),
    "throttle": ("relay/services/throttling/__init__.py", "admit_many"),
    "bookkeeping": ("relay/services/delivery.py", "record"),
    "journal": ("relay/services/delivery_journal.py", "keep"),
}


def profile(push: Any, registrations: list[Any], gap: float) -> dict[str, float]:
    """Each push under cProfile on the thread's CPU time, paced by sleeps (not profiled)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile(time.thread_time)
    for registration in registrations:
        profiler.enable()
        push(registration)
        profiler.disable()
        time.sleep(gap)
    stats: Any = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    total = sum(entry[2] for entry in stats.values())
    shares = {}
    for step, (path, function) in STEPS.items():
        spent = sum(
            entry[3]
            for (file, _, name), entry in stats.items()
            if file.endswith(path) and name == function
        )
        shares[step] = round(spent / total, 3)
    return shares


if __name__ == "__main__":
    main()
