"""The web process's CPU per request on its cheapest UnifiedPush path: kept-alive
connections POSTing a 512-byte body to an endpoint that does not exist (a 404 from the
resource, with every header and the access line and count of any answer; no database).

It starts the web process as the Procfile does (`python -m pushsite.server`, one worker,
defaults: no PostgreSQL needed) from the checkout this file is in, drives it from this
process for `--seconds` after a warm-up, and reports requests per second and the worker's
CPU per request (from /proc), with the load average. Prints and writes
bench/results/web_floor.json.

Run: `.venv/bin/python bench/web_floor.py` (options: --seconds, --connections).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import wait_http, write_results  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

TOKEN = "v4.local." + "A" * 64  # the shape of an endpoint token; no such endpoint


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(port: int, connections: int, seconds: float) -> int:
    request = (
        f"POST /push/{TOKEN} HTTP/1.1\r\nHost: localhost\r\nTTL: 60\r\nContent-Length: 512\r\n\r\n"
    ).encode() + b"x" * 512
    answered = 0
    stop = time.monotonic() + seconds

    async def client() -> None:
        nonlocal answered
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 404 "), head
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            answered += 1
        writer.close()

    await asyncio.gather(*(client() for _ in range(connections)))
    return answered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=64)
    args = parser.parse_args()

    port = free_port()
    var_dir = tempfile.mkdtemp(prefix="web-floor-")
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("DATABASE_URL", "CELERY_BROKER_URL", "CACHE_URL", "RELAY_STATE_URL")
    }
    env.update(VAR_DIR=var_dir, WEB_BIND=f"127.0.0.1:{port}", WEB_WORKERS="1", LOG_LEVEL="WARNING")
    web = subprocess.Popen(
        [sys.executable, "-m", "pushsite.server"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=60)
        [worker] = map(int, Path(f"/proc/{web.pid}/task/{web.pid}/children").read_text().split())
        asyncio.run(_drive(port, args.connections, args.warmup))
        load_before = os.getloadavg()[0]
        cpu, started = _cpu_seconds(worker), time.monotonic()
        answered = asyncio.run(_drive(port, args.connections, args.seconds))
        cpu, elapsed = _cpu_seconds(worker) - cpu, time.monotonic() - started
        results = {
            "requests_per_second": round(answered / elapsed, 1),
            "worker_cpu_ms_per_request": round(1000 * cpu / answered, 4),
            "connections": args.connections,
            "seconds": args.seconds,
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        }
    finally:
        web.terminate()
        web.wait(60)
        shutil.rmtree(var_dir, ignore_errors=True)
    write_results("web_floor", results)


if __name__ == "__main__":
    main()
