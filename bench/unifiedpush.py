"""UnifiedPush benchmark: POST -> push iq -> the phone's answer, our relay side by side with
Prosody's mod_unified_push, in the same run, on the same Prosody, driven the same way.

One Prosody (bench/peers/prosody-unifiedpush.cfg.lua) routes both sides:
- ours: application server --HTTP--> web (pushsite.server) --the direct path (TCP)--> gateway
  --component link--> Prosody --c2s--> phone, and the phone's `result` back to the gateway,
  which answers the web process (then the POST 201) and writes the delivery record; a
  message the phone does not take at once goes through the store (PostgreSQL, NOTIFY).
  `--direct-seconds 0` measures the store-first path alone;
- Prosody's: application server --HTTP--> Prosody (mod_unified_push, `storage` backend)
  --c2s--> phone, and the phone's `result` back to Prosody, which then answers the POST 201.

The driver (this process) keeps N HTTP/1.1 keep-alive connections, each POSTing to its own
endpoint in a closed loop: POST, wait for the HTTP answer AND for the phone to have received
and answered that message, then the next. A relay is complete at the later of the two. The
phones are raw XMPP clients in this process (8 accounts, endpoints spread over them) that
answer every push `result` at once. Both sides thus see the same offered load shape.

Then open-loop phases (--rates, default 1000 and 2000 POSTs per second, on up to 64
connections): both sides offered the same rate, latency counted from when each POST was due,
so the p99s compare at equal load (a closed loop compares them at each side's own saturation).

Figures per side and concurrency (16, 64) or offered rate: relays per second, latency
POST -> complete (p50/p95/p99), POST -> HTTP answer, POST -> phone; CPU per relay of every
process (web, gateway, PostgreSQL, Prosody, this driver); the machine's busy fraction and
load average.
Our side's figures include the gateway's deletes and delivery records (a phase ends only when
no message is stored and every accepted one has its delivery record). Prints and writes
bench/results/unifiedpush.json.

Run with `make bench` or `.venv/bin/python -m tests.support.services -- .venv/bin/python
bench/unifiedpush.py` (needs prosody and prosody-modules). Options: --seconds, --body-bytes,
--web-workers, --web-threads, --phones, --concurrency 16,64.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import os
import platform
import re
import subprocess
import sys
import time
import xml.parsers.expat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import percentiles, prepare_database, wait_http, write_results  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.xmpp_servers import ProsodyServer  # noqa: E402

BENCH_DB = os.environ.get("UNIFIEDPUSH_BENCH_DB", "unifiedpush_bench")
# The open-loop phases' connections when no closed loop sets them (the largest one does).
OPEN_LOOP_CONNECTIONS = 64
UP_NS = "http://gultsch.de/xmpp/drafts/unified-push"
OURS, PROSODY = "up.localhost", "upm.localhost"
SECRET = "bench-component-secret"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- processes
class BenchProsody(ProsodyServer):
    """Prosody with our component and mod_unified_push (and HTTP) from the bench config."""

    def __init__(self, workdir: Path) -> None:
        super().__init__([(OURS, SECRET)], workdir=workdir)
        self.http_port = free_port()

    def _write_config(self) -> None:
        for folder in ("data", "certs"):
            (self._workdir / folder).mkdir(exist_ok=True)
        source = ROOT / "bench" / "peers" / "prosody-unifiedpush.cfg.lua"
        self.config_path.write_text(source.read_text())

    def _environment(self) -> dict[str, str]:
        return {
            "PROSODY_LAB": str(self._workdir),
            "C2S_PORT": str(self._c2s_port),
            "COMPONENT_PORT": str(self._component_port),
            "HTTP_PORT": str(self.http_port),
            "COMPONENT_SECRET": SECRET,
        }


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def tree_cpu(root: int, *, descendants: bool = True) -> float:
    """User + system CPU seconds of a process (and its live descendants)."""
    total = 0
    for pid in process_tree(root) if descendants else [root]:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def machine_busy() -> tuple[int, int]:
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def postmaster_pid(database_url: str) -> int:
    import psycopg

    with psycopg.connect(database_url) as conn:
        data_dir = conn.execute("SHOW data_directory").fetchone()[0]
    return int(Path(data_dir, "postmaster.pid").read_text().split()[0])


# --------------------------------------------------------------------------- raw XMPP phone
class RawPhone(asyncio.Protocol):
    """A minimal c2s client: PLAIN auth, bind, presence; answers every push `result`."""

    def __init__(self, on_push: Any) -> None:
        self.on_push = on_push
        self.transport: asyncio.Transport | None = None
        self.parser = self._new_parser()
        self.depth = 0
        self.waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.events: asyncio.Queue[str] = asyncio.Queue()
        self.stanza: dict[str, Any] | None = None
        self.text: list[str] = []
        self.ids = itertools.count()

    def _new_parser(self) -> Any:
        parser = xml.parsers.expat.ParserCreate(namespace_separator=" ")
        parser.StartElementHandler = self._start
        parser.EndElementHandler = self._end
        parser.CharacterDataHandler = self._chars
        parser.buffer_text = True
        return parser

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.Parse(data, False)

    def _start(self, tag: str, attrs: dict[str, str]) -> None:
        self.depth += 1
        if self.depth == 1:
            self.events.put_nowait("stream")
        elif self.depth == 2:
            self.stanza = {"tag": tag, "attrs": attrs, "children": [], "text": ""}
            self.text = []
        elif self.stanza is not None:
            self.stanza["children"].append((tag, attrs))

    def _chars(self, data: str) -> None:
        if self.depth >= 3:
            self.text.append(data)

    def _end(self, tag: str) -> None:
        self.depth -= 1
        if self.depth != 1 or self.stanza is None:
            return
        stanza, self.stanza = self.stanza, None
        attrs = stanza["attrs"]
        if tag == "jabber:client iq" and attrs.get("type") == "set":
            children = stanza["children"]
            if children and children[0][0] == f"{UP_NS} push":
                self.transport.write(
                    b"<iq type='result' id='%s' to='%s'/>"
                    % (attrs["id"].encode(), attrs["from"].encode())
                )
                self.on_push("".join(self.text))
                return
        stanza["text"] = "".join(self.text)
        waiter = self.waiting.pop(attrs.get("id", ""), None)
        if waiter is not None:
            waiter.set_result(stanza)
        else:
            self.events.put_nowait(tag.split(" ")[-1])

    def send(self, data: str) -> None:
        assert self.transport is not None
        self.transport.write(data.encode())

    async def request(self, xml_text: str, iq_id: str) -> dict[str, Any]:
        future = asyncio.get_running_loop().create_future()
        self.waiting[iq_id] = future
        self.send(xml_text)
        return await asyncio.wait_for(future, 10)

    async def expect(self, name: str) -> None:
        while await asyncio.wait_for(self.events.get(), 10) != name:
            pass

    async def login(self, username: str, password: str, resource: str) -> None:
        header = (
            "<?xml version='1.0'?><stream:stream to='localhost' xmlns='jabber:client' "
            "xmlns:stream='http://etherx.jabber.org/streams' version='1.0'>"
        )
        self.send(header)
        await self.expect("features")
        plain = base64.b64encode(f"\0{username}\0{password}".encode()).decode()
        self.send(
            f"<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>{plain}</auth>"
        )
        await self.expect("success")
        self.parser = self._new_parser()
        self.depth = 0
        self.send(header)
        await self.expect("features")
        await self.request(
            "<iq type='set' id='bind'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'>"
            f"<resource>{resource}</resource></bind></iq>",
            "bind",
        )
        self.send("<presence/>")

    async def register(self, component: str) -> str:
        iq_id = f"reg{next(self.ids)}"
        application = base64.b64encode(os.urandom(32)).decode()
        instance = base64.b64encode(os.urandom(32)).decode()
        reply = await self.request(
            f"<iq type='set' id='{iq_id}' to='{component}'><register xmlns='{UP_NS}' "
            f"application='{application}' instance='{instance}'/></iq>",
            iq_id,
        )
        for tag, attrs in reply["children"]:
            if tag == f"{UP_NS} registered":
                return attrs["endpoint"]
        raise RuntimeError(f"registration with {component} refused: {reply}")


# --------------------------------------------------------------------------- HTTP driver
class Connection:
    """One HTTP/1.1 keep-alive connection that POSTs and reads the answer."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path = parts.path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.reconnects = 0

    async def post(self, body: bytes) -> int:
        for _ in range(3):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
                self.reconnects += 1
            self.writer.write(
                (
                    f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                    f"Content-Type: application/octet-stream\r\nTTL: 60\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode()
                + body
            )
            try:
                head = await self.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                self.close()
                continue
            status = int(head[9:12])
            match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            if match and int(match.group(1)):
                await self.reader.readexactly(int(match.group(1)))
            if re.search(rb"(?i)\r\nconnection: *close", head):
                self.close()
            return status
        raise ConnectionError("the server keeps closing the connection")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


@dataclass
class Phase:
    side: str
    concurrency: int
    totals: list[float] = field(default_factory=list)
    http: list[float] = field(default_factory=list)
    phone: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    lost: int = 0


class Driver:
    def __init__(self, body_bytes: int) -> None:
        self.body_bytes = body_bytes
        self.sequence = itertools.count(1)
        self.waiters: dict[int, asyncio.Future[float]] = {}
        self.phones: list[RawPhone] = []
        self.received = 0
        self.accepted: dict[str, int] = {}  # 201s per side, for the drain
        self.padding = os.urandom(body_bytes)

    def on_push(self, text: str) -> None:
        self.received += 1
        body = base64.b64decode(text)
        seq = int(body.split(b" ", 1)[0])
        waiter = self.waiters.pop(seq, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(time.perf_counter())

    async def add_phone(self, server: BenchProsody, username: str, password: str) -> RawPhone:
        loop = asyncio.get_running_loop()
        _, phone = await loop.create_connection(
            lambda: RawPhone(self.on_push), "127.0.0.1", server.c2s_port
        )
        await phone.login(username, password, "Conversations.bench")
        self.phones.append(phone)
        return phone

    def body(self, seq: int) -> bytes:
        """`<seq> ` and random padding up to body_bytes (what the phone reads back)."""
        head = b"%d " % seq
        return head + self.padding[: max(0, self.body_bytes - len(head))]

    async def run(
        self, phase: Phase, endpoints: list[str], seconds: float, record_from: float
    ) -> float:
        connections = [Connection(url) for url in endpoints[: phase.concurrency]]
        stop_at = time.perf_counter() + seconds
        loop = asyncio.get_running_loop()

        async def loop_one(connection: Connection) -> None:
            while time.perf_counter() < stop_at:
                seq = next(self.sequence)
                waiter: asyncio.Future[float] = loop.create_future()
                self.waiters[seq] = waiter
                started = time.perf_counter()
                status = await connection.post(self.body(seq))
                answered = time.perf_counter()
                if status != 201:
                    self.waiters.pop(seq, None)
                    phase.errors[str(status)] = phase.errors.get(str(status), 0) + 1
                    await asyncio.sleep(0.01)
                    continue
                self.accepted[phase.side] = self.accepted.get(phase.side, 0) + 1
                try:
                    at_phone = await asyncio.wait_for(waiter, 30)
                except TimeoutError:
                    phase.lost += 1
                    continue
                if started >= record_from:
                    done = max(answered, at_phone)
                    phase.totals.append(done - started)
                    phase.http.append(answered - started)
                    phase.phone.append(at_phone - started)

        started = time.perf_counter()
        await asyncio.gather(*(loop_one(c) for c in connections))
        for connection in connections:
            connection.close()
        return time.perf_counter() - started

    async def run_open(
        self, phase: Phase, endpoints: list[str], seconds: float, rate: float, record: bool
    ) -> None:
        """Open loop: a POST every 1/rate seconds, each on a connection that is free (up to
        the phase's connections); latency counts from when the POST was due, so a POST that
        waited for a free connection counts its wait (no coordinated omission)."""
        connections: asyncio.Queue[Connection] = asyncio.Queue()
        for url in endpoints[: phase.concurrency]:
            connections.put_nowait(Connection(url))
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()

        async def one(connection: Connection, due: float) -> None:
            seq = next(self.sequence)
            waiter: asyncio.Future[float] = loop.create_future()
            self.waiters[seq] = waiter
            try:
                status = await connection.post(self.body(seq))
                answered = time.perf_counter()
                if status != 201:
                    self.waiters.pop(seq, None)
                    phase.errors[str(status)] = phase.errors.get(str(status), 0) + 1
                    return
                self.accepted[phase.side] = self.accepted.get(phase.side, 0) + 1
                try:
                    at_phone = await asyncio.wait_for(waiter, 30)
                except TimeoutError:
                    phase.lost += 1
                    return
                if record:
                    phase.totals.append(max(answered, at_phone) - due)
                    phase.http.append(answered - due)
                    phase.phone.append(at_phone - due)
            finally:
                connections.put_nowait(connection)

        started = time.perf_counter()
        count = int(seconds * rate)
        for n in range(count):
            due = started + n / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            connection = await connections.get()
            task = asyncio.create_task(one(connection, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        while not connections.empty():
            connections.get_nowait().close()


# --------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=15.0, help="measured per phase")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument(
        "--concurrency", default="16,64", help="closed-loop phases: connections; empty for none"
    )
    parser.add_argument(
        "--rates",
        default="1000,2000",
        help="open-loop phases: POSTs per second offered to each side (64 connections); "
        "empty for none",
    )
    parser.add_argument("--body-bytes", type=int, default=512)
    parser.add_argument("--phones", type=int, default=8)
    parser.add_argument("--web-workers", type=int, default=1)
    parser.add_argument("--web-threads", type=int, default=16)
    parser.add_argument("--gateway-threads", type=int, default=8)
    parser.add_argument(
        "--direct-seconds",
        type=float,
        default=0.5,
        help="RELAY_UNIFIEDPUSH_DIRECT_SECONDS; 0 stores every message first",
    )
    args = parser.parse_args()
    levels = [int(value) for value in args.concurrency.split(",") if value.strip()]
    rates = [int(value) for value in args.rates.split(",") if value.strip()]

    admin_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    database_url = prepare_database(admin_url, BENCH_DB)
    os.environ.update(
        {
            "DATABASE_URL": database_url,
            "DJANGO_SETTINGS_MODULE": "pushsite.settings",
            "LOG_LEVEL": "WARNING",
            # Limits would measure themselves: the driver is one client hammering 64 endpoints.
            "RELAY_UNIFIEDPUSH_ENDPOINT_RATE": "0/0",
            "RELAY_UNIFIEDPUSH_TENANT_RATE": "0/0",
            "RELAY_GATEWAY_THREADS": str(args.gateway_threads),
            "RELAY_UNIFIEDPUSH_DIRECT_SECONDS": str(args.direct_seconds),
        }
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from relay.models import ComponentLink, Tenant
    from relay.unifiedpush.models import UnifiedPushDelivery, UnifiedPushMessage
    from tests.support.unifiedpush_components import serving_unifiedpush

    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"up-bench-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    prosody = BenchProsody(workdir / "prosody")
    prosody.start()
    web_port = free_port()
    web = subprocess.Popen(  # as the Procfile starts it
        [sys.executable, "-m", "pushsite.server"],
        cwd=ROOT,
        env={
            **os.environ,
            # application_name: PostgreSQL's CPU is split by who asks.
            "DATABASE_URL": database_url + "?application_name=web",
            "WEB_BIND": f"127.0.0.1:{web_port}",
            "WEB_WORKERS": str(args.web_workers),
            "WEB_THREADS": str(args.web_threads),
        },
    )
    tenant = Tenant.objects.create(name="bench")
    component = serving_unifiedpush(
        tenant=tenant,
        jid=OURS,
        secret=SECRET,
        host="127.0.0.1",
        port=prosody.component_port,
        endpoint_url=f"http://127.0.0.1:{web_port}",
    )
    gateway = subprocess.Popen(
        [sys.executable, "manage.py", "run_gateway"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url + "?application_name=gateway"},
    )
    results: dict[str, Any] = {}
    try:
        wait_http(f"http://127.0.0.1:{web_port}/healthz", timeout=30)
        deadline = time.monotonic() + 30
        while not ComponentLink.objects.filter(component=component, state="up").exists():
            if time.monotonic() > deadline:
                raise SystemExit("the gateway did not connect to Prosody")
            time.sleep(0.2)
        pids = {
            "web": web.pid,
            "gateway": gateway.pid,
            "postgresql": postmaster_pid(database_url),
            "prosody": prosody.pid or 0,
            "driver (HTTP client + phones)": os.getpid(),
        }
        results = asyncio.run(
            measure(
                args,
                levels,
                rates,
                prosody,
                pids,
                lambda: (
                    UnifiedPushMessage.objects.count(),
                    UnifiedPushDelivery.objects.count(),
                ),
                lambda: postgres_cpu_by_client(database_url),
            )
        )
    finally:
        for process in (gateway, web):
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            if process.poll() is None:
                process.kill()
        prosody.close()
    results.update(
        {
            "benchmark": "unifiedpush",
            "body_bytes": args.body_bytes,
            "seconds_per_phase": args.seconds,
            "web": f"python -m pushsite.server, {args.web_workers} workers x "
            f"{args.web_threads} threads",
            "gateway_threads": args.gateway_threads,
            "direct_seconds": args.direct_seconds,
            "phones": args.phones,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "prosody": subprocess.run(
                ["dpkg-query", "-W", "prosody", "prosody-modules"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.split(),
        }
    )
    write_results("unifiedpush", results)
    print_table(results)


def postgres_cpu_by_client(database_url: str) -> dict[str, float]:
    """CPU seconds of PostgreSQL's live processes by who they serve: the web's connections,
    the gateway's, this driver's, and PostgreSQL's own (autovacuum, WAL writer, ...)."""
    import psycopg

    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT pid, application_name, backend_type FROM pg_stat_activity"
        ).fetchall()
        [(commits,)] = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchall()
    # Commits per relay, in thousandths like the rest (x 1000 below): how well batching works.
    out: dict[str, float] = {"commits (x1000)": float(commits)}
    for pid, application, backend_type in rows:
        if backend_type == "client backend":
            group = application if application in ("web", "gateway") else "driver"
        else:
            group = backend_type
        out[group] = out.get(group, 0.0) + tree_cpu(pid, descendants=False)
    return out


async def measure(
    args: Any,
    levels: list[int],
    rates: list[int],
    prosody: BenchProsody,
    pids: dict[str, int],
    stored: Any,
    postgres_split: Any,
) -> dict[str, Any]:
    driver = Driver(args.body_bytes)
    phones = []
    for index in range(args.phones):
        username, password = f"phone{index}", f"password{index}"
        from tests.support.xmpp_client import register_account

        await asyncio.to_thread(register_account, prosody, username, password)
        phones.append(await driver.add_phone(prosody, username, password))
    most = max(levels, default=OPEN_LOOP_CONNECTIONS)
    endpoints: dict[str, list[str]] = {OURS: [], PROSODY: []}
    for side in (OURS, PROSODY):
        for index in range(most):
            endpoints[side].append(await phones[index % len(phones)].register(side))
    phases: dict[str, Any] = {}

    async def measured(name: str, side: str, label: str, concurrency: int, run: Any) -> None:
        """Warm up, then one measured phase: `run(phase, seconds, record)` drives it."""
        phase = Phase(name, concurrency)
        await run(phase, args.warmup, False)
        await drain(stored if side == OURS else None, driver.accepted.get(name, 0))
        cpu_before = {key: cpu_of(key, pid) for key, pid in pids.items()}
        pg_before = await asyncio.to_thread(postgres_split)
        busy_before = machine_busy()
        started = time.perf_counter()
        await run(phase, args.seconds, True)
        drained = await drain(stored if side == OURS else None, driver.accepted.get(name, 0))
        elapsed = time.perf_counter() - started
        busy_after = machine_busy()
        cpu = {key: cpu_of(key, pid) - cpu_before[key] for key, pid in pids.items()}
        pg_after = await asyncio.to_thread(postgres_split)
        relays = len(phase.totals)
        phases[f"{name}@{label}"] = {
            "side": name,
            "connections": concurrency,
            "relays": relays,
            "relays_per_second": round(relays / elapsed, 1),
            "latency_ms": percentiles(phase.totals),
            "post_to_http_answer_ms": percentiles(phase.http),
            "post_to_phone_ms": percentiles(phase.phone),
            "errors": phase.errors,
            "lost": phase.lost,
            "drain_seconds_after_last_post": round(drained, 3),
            "cpu_ms_per_relay": {
                key: round(seconds * 1000 / max(1, relays), 3) for key, seconds in cpu.items()
            },
            # Processes that ended during the phase (an autovacuum worker) are missing.
            "postgresql_cpu_ms_per_relay_by_client": {
                key: round((value - pg_before.get(key, 0.0)) * 1000 / max(1, relays), 3)
                for key, value in sorted(pg_after.items())
                if value - pg_before.get(key, 0.0) > 0
            },
            "cpu_cores_busy": {key: round(seconds / elapsed, 2) for key, seconds in cpu.items()},
            "machine_busy_fraction": round(
                (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1]), 3
            ),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        }
        result = phases[f"{name}@{label}"]
        print(
            f"{name}@{label}: {result['relays_per_second']}/s p99 {result['latency_ms']['p99']} ms",
            flush=True,
        )

    sides = ((OURS, "relay"), (PROSODY, "prosody_mod_unified_push"))
    for concurrency in levels:
        for side, name in sides:

            async def closed(phase: Phase, seconds: float, record: bool, side: str = side) -> None:
                await driver.run(
                    phase,
                    endpoints[side],
                    seconds,
                    record_from=time.perf_counter() if record else float("inf"),
                )

            await measured(name, side, str(concurrency), concurrency, closed)
    for rate in rates:
        for side, name in sides:

            async def open_(
                phase: Phase, seconds: float, record: bool, side: str = side, rate: int = rate
            ) -> None:
                await driver.run_open(phase, endpoints[side], seconds, rate, record)

            await measured(name, side, f"{rate}/s", most, open_)
    comparison: dict[str, Any] = {}
    for label in [str(c) for c in levels] + [f"{r}/s" for r in rates]:
        ours, theirs = phases[f"relay@{label}"], phases[f"prosody_mod_unified_push@{label}"]
        comparison[label] = {
            "rate_ratio_ours_to_prosody": round(
                ours["relays_per_second"] / max(0.1, theirs["relays_per_second"]), 3
            ),
            "p99_ratio_ours_to_prosody": round(
                ours["latency_ms"]["p99"] / max(0.01, theirs["latency_ms"]["p99"]), 3
            ),
        }
    return {"phases": phases, "comparison": comparison}


def cpu_of(name: str, pid: int) -> float:
    """The driver's own CPU only: web, gateway and Prosody are its children."""
    return tree_cpu(pid, descendants=not name.startswith("driver"))


async def drain(stored: Any, accepted: int) -> float:
    """Wait until our side has deleted every delivered message and written a delivery record
    for every message it accepted (Prosody's keeps none)."""
    started = time.perf_counter()
    if stored is None:
        return 0.0
    while True:
        messages_left, records = await asyncio.to_thread(stored)
        if not messages_left and records >= accepted:
            break
        if time.perf_counter() - started > 60:
            raise RuntimeError("messages still stored a minute after the last POST")
        await asyncio.sleep(0.05)
    return time.perf_counter() - started


def print_table(results: dict[str, Any]) -> None:
    print()
    print(f"{'phase':34} {'relays/s':>9} {'p50':>7} {'p95':>7} {'p99':>7}  cpu ms/relay")
    for name, phase in results["phases"].items():
        latency = phase["latency_ms"]
        cpu = ", ".join(f"{k.split(' ')[0]} {v}" for k, v in phase["cpu_ms_per_relay"].items())
        print(
            f"{name:34} {phase['relays_per_second']:>9} {latency['p50']:>7} "
            f"{latency['p95']:>7} {latency['p99']:>7}  {cpu}  (load {phase['loadavg'][0]})"
        )
        split = phase.get("postgresql_cpu_ms_per_relay_by_client", {})
        if name.startswith("relay@") and split:
            print(
                f"{'':34} postgresql by client: " + ", ".join(f"{k} {v}" for k, v in split.items())
            )
    for label, ratio in results["comparison"].items():
        where = f"offered {label}" if label.endswith("/s") else f"at {label} connections"
        print(
            f"{where}: ours/prosody rate {ratio['rate_ratio_ours_to_prosody']}"
            f", p99 {ratio['p99_ratio_ours_to_prosody']}"
        )


if __name__ == "__main__":
    main()
