"""The gateway's memory per XEP-0114 component link. Prints and writes (bench/results/links.json):
the gateway process's memory (from /proc/<pid>/smaps_rollup and /proc/<pid>/status) as its
links grow in steps within one gateway run, the bytes per link (least squares over the
steps), and its idle CPU per link.

At each step (`--links 0,100,200,300,400,500`, the total held) the benchmark starts the XMPP
server's end of each new link (bench/component_server.py), adds a Component row pointing at
it, and waits until the gateway holds every link (the handshake passed and the gateway wrote
the link's state `up`). It reads the gateway's memory then ("connected": the new links have
carried nothing yet), sends `--publishes` publishes through each new link, each to a
registration of its own, all in flight at once, waits for every answer, and reads the memory
again ("published": every link so far has carried its publishes), then counts the gateway's
and PostgreSQL's CPU over `--idle-seconds` with nothing sent (the lease rounds, the
watchdog). The publishes queue in the broker: no worker runs, the gateway's part ends at the
broker's confirm. The gateway runs with its defaults (RELAY_GATEWAY_THREADS,
RELAY_COMPONENT_POLL_SECONDS ...). RELAY_BENCH_DB names the database it re-creates (default
relay_bench_links).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import bench_app, django_on_fresh_database, write_results  # noqa: E402
from bench.component_server import ComponentServer  # noqa: E402
from bench.relay import cpu_seconds, machine_busy, server_pids  # noqa: E402
from tests.support.processes import child_pids  # noqa: E402

BENCH_DB = os.environ.get("RELAY_BENCH_DB", "relay_bench_links")
# smaps_rollup's and status's figures kept (kB there, bytes here).
ROLLUP = ("Rss", "Pss", "Pss_Anon", "Private_Clean", "Private_Dirty", "Shared_Clean", "Anonymous")
STATUS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "VmData")


def memory(pid: int) -> dict[str, int]:
    """The process's memory in bytes: smaps_rollup's Rss, Pss, Private_* (USS is their sum),
    status's VmRSS and friends, and its thread count."""
    figures: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        if key in ROLLUP:
            figures[key] = int(value.split()[0]) * 1024
    figures["USS"] = figures["Private_Clean"] + figures["Private_Dirty"]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in STATUS:
            figures[key] = int(value.split()[0]) * 1024
        elif key == "Threads":
            figures["Threads"] = int(value)
    return figures


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return sxy / sxx if sxx else 0.0


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--links",
        default="0,100,200,300,400,500",
        help="links the gateway holds at each step, ascending, comma-separated",
    )
    parser.add_argument("--publishes", type=int, default=20, help="publishes through each link")
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=9.0,
        help="the window of each step's idle CPU (three lease rounds at the default poll)",
    )
    args = parser.parse_args()
    steps = [int(n) for n in args.links.split(",") if n.strip()]
    if steps != sorted(steps) or not steps or steps[0] < 0:
        parser.error("--links: ascending counts from 0 up")

    # No worker runs: the gateway queues its sends, as it did when these figures were taken.
    database_url = django_on_fresh_database(BENCH_DB, RELAY_DIRECT_SEND_SHARE="0")
    broker_url = os.environ["CELERY_BROKER_URL"]
    from relay.identifiers import new_node, new_secret
    from relay.models import Component, ComponentLink, LinkState, Registration, Service
    from tests.support import broker

    broker.purge()
    app = bench_app()
    tenant = app.tenant
    # Its probe listener on a free port: another gateway on this machine may hold the default.
    env = dict(os.environ, GATEWAY_PROBE_LISTEN="127.0.0.1:0")
    gateway = subprocess.Popen([sys.executable, "manage.py", "run_gateway"], cwd=ROOT, env=env)

    def add_links(first: int, servers: list[ComponentServer]) -> list[list[tuple[str, str, str]]]:
        """Component rows for the servers, and each one's registrations as publishes."""
        components = Component.objects.bulk_create(
            Component(
                tenant=tenant,
                app=app,
                jid=f"push{first + i}.bench",
                secret="bench-secret",
                host="127.0.0.1",
                port=server.port,
            )
            for i, server in enumerate(servers)
        )
        publishes = []
        registrations = []
        for component in components:
            mine = [
                Registration(
                    app=app,
                    component=component,
                    service=Service.FCM,
                    device_hash=f"{component.pk:08x}{p:032x}",
                    account_domain="localhost",
                    token=f"bench-token-{component.pk}-{p}",
                    node=new_node(),
                    secret=new_secret(),
                )
                for p in range(args.publishes)
            ]
            registrations += mine
            publishes.append(
                [(f"{component.pk}-{p}", r.node, r.secret) for p, r in enumerate(mine)]
            )
        Registration.objects.bulk_create(registrations, batch_size=2000)
        return publishes

    def links_up() -> int:
        return ComponentLink.objects.filter(state=LinkState.UP).count()

    async def wait_links_up(count: int, timeout: float) -> None:
        """The gateway's own word that it holds the links: their state written `up`."""
        deadline = time.monotonic() + timeout
        while (up := await asyncio.to_thread(links_up)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{up} of {count} links up")
            await asyncio.sleep(0.1)

    async def run() -> dict[str, object]:
        servers: list[ComponentServer] = []
        pids = {"gateway": gateway.pid}
        databases = server_pids(database_url, broker_url)
        databases.pop("broker", None)

        def cpu() -> dict[str, float]:
            figures = {name: cpu_seconds(pid) for name, pid in pids.items()}
            for name, pid in databases.items():
                figures[name] = cpu_seconds(pid) + sum(cpu_seconds(c) for c in child_pids(pid))
            return figures

        rows: list[dict[str, Any]] = []
        for held in steps:
            new = [
                ComponentServer(f"push{n}.bench", "bench-secret") for n in range(len(servers), held)
            ]
            for server in new:
                await server.start()
            publishes = await asyncio.to_thread(add_links, len(servers), new)
            servers += new
            started = time.perf_counter()
            try:
                for server in new:
                    await server.wait_connected(timeout=180)  # a loaded machine starts slowly
            except TimeoutError:
                up = sum(1 for server in servers if server.connected)
                raise SystemExit(
                    f"{up} of {held} links connected within 180 s (does the gateway's log say "
                    "link.lease_lost? Then the links it started at once held its event loop "
                    "past its leases' deadline, and it started them all again)"
                ) from None
            await wait_links_up(held, timeout=180)
            if held == 0:
                await wait_gateway_ready(gateway)
            connected_in = time.perf_counter() - started
            connected = memory(gateway.pid)
            started = time.perf_counter()
            await asyncio.gather(
                *(
                    server.publish_all(batch, window=args.publishes, timeout=300)
                    for server, batch in zip(new, publishes, strict=True)
                )
            )
            published_in = time.perf_counter() - started
            errors = sum(
                1 for server in new for kind in server.answer_types.values() if kind != "result"
            )
            published = memory(gateway.pid)
            before, busy_before = cpu(), machine_busy()
            idle_started = time.perf_counter()
            await asyncio.sleep(args.idle_seconds)  # the measuring window, not a wait
            elapsed = time.perf_counter() - idle_started
            after, busy_after = cpu(), machine_busy()
            row: dict[str, Any] = {
                "links": held,
                "connected_seconds": round(connected_in, 2),
                "published_seconds": round(published_in, 2),
                "publish_errors": errors,
                "connected": connected,
                "published": published,
                "idle_cpu_cores": {
                    name: round((after[name] - before[name]) / elapsed, 4) for name in after
                },
                "machine_busy_cores": round((busy_after[0] - busy_before[0]) / elapsed, 2),
                "load_average": load(),
            }
            rows.append(row)
            print(
                f"{held} links: connected in {connected_in:.1f} s, Rss {mib(connected['Rss'])} "
                f"Pss {mib(connected['Pss'])} USS {mib(connected['USS'])} MiB; after "
                f"{args.publishes} publishes each ({errors} errors): Rss {mib(published['Rss'])} "
                f"Pss {mib(published['Pss'])} USS {mib(published['USS'])} MiB, "
                f"{published['Threads']} threads; idle CPU {row['idle_cpu_cores']} cores; "
                f"load {row['load_average']}",
                flush=True,
            )
        # The gateway first: servers closed under it would only see it reconnect.
        gateway.terminate()
        await asyncio.to_thread(gateway.wait, 60)
        for server in servers:
            await server.close()
        return summarize(rows)

    load_before = load()
    try:
        results = asyncio.run(run())
    finally:
        gateway.terminate()
        try:
            gateway.wait(30)
        except subprocess.TimeoutExpired:
            gateway.kill()
    results.update(
        {
            "benchmark": "links",
            "steps": steps,
            "publishes_per_link": args.publishes,
            "idle_seconds": args.idle_seconds,
            "load_average_before": load_before,
            "load_average_after": load(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        }
    )
    write_results("links", results)


async def wait_gateway_ready(gateway: subprocess.Popen[bytes]) -> None:
    """With no links to wait for, the gateway's first lease round: its instance row."""
    from relay.models import GatewayInstance

    deadline = time.monotonic() + 120
    while not await asyncio.to_thread(GatewayInstance.objects.exists):
        if gateway.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the gateway did not start")
        await asyncio.sleep(0.1)


def summarize(rows: list[dict[str, Any]]) -> dict[str, object]:
    """Bytes per link over the steps that hold links (the first step's gateway, before any
    link, has yet to warm its threads and connections): "published", the least-squares slope
    of the memory after every link carried its publishes; "connected", what the links new at
    a step added before they carried any (the memory when they connected less the previous
    step's after its publishes, summed over the steps, per new link)."""
    held = [row for row in rows if row["links"] > 0]
    keys = ("Rss", "Pss", "USS", "Private_Dirty", "VmRSS", "RssAnon")
    per_link: dict[str, dict[str, int]] = {}
    idle: dict[str, float] = {}
    if len(held) >= 2:
        per_link["published"] = {
            key: round(slope([(row["links"], row["published"][key]) for row in held]))
            for key in keys
        }
        pairs = list(itertools.pairwise(held))
        added = sum(now["links"] - before["links"] for before, now in pairs)
        per_link["connected"] = {
            key: round(
                sum(now["connected"][key] - before["published"][key] for before, now in pairs)
                / added
            )
            for key in keys
        }
        for name in held[0]["idle_cpu_cores"]:
            points = [(row["links"], row["idle_cpu_cores"][name]) for row in held]
            idle[name] = round(slope(points) * 1e6, 2)
    line = "; ".join(
        f"{phase}: " + " ".join(f"{k} {v}" for k, v in figures.items())
        for phase, figures in per_link.items()
    )
    print(f"bytes per link ({len(held)} steps with links): {line}", flush=True)
    print(f"idle CPU per link: {idle} µs per second", flush=True)
    return {
        "steps_detail": rows,
        "bytes_per_link": per_link,
        "idle_cpu_us_per_link_per_second": idle,
    }


def mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


if __name__ == "__main__":
    main()
