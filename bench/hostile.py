"""The gateway under hostile input: valid publishes on a link that a flood of hostile stanzas
shares, and how fast a link dropped by bad input comes back.

The benchmark plays the XMPP server's end of one component link (as Prosody or ejabberd would)
and runs the real gateway process against PostgreSQL and Redis; no worker runs (the figure is
the gateway's answer, not the send). Two phases:

1. Flood: valid publishes go out at a steady rate (`--good-rate`) for a few seconds, then a
   flood of `--hostile` hostile stanzas is written as fast as the gateway reads them (senders
   that are not JIDs, missing nodes, oversized fields, unknown nodes, wrong secrets, payloads
   we do not serve, commands without a form) while the valid publishes go on. Figures: latency
   from a valid publish to its answer (p50/p95/p99) before and during the flood, what every
   valid and hostile stanza was answered (by kind and error condition, and how many were never
   answered), the gateway's CPU per stanza, its ERROR log lines, and the machine's load.
2. Drops: `--drops` times in a row, a not-well-formed stanza ends the stream; the figure is the
   time from the bad input to the gateway's next handshake, and what it sent before closing.

Prints and writes bench/results/hostile.json. Run under private servers:
`.venv/bin/python -m tests.support.services -- .venv/bin/python bench/hostile.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import django_on_fresh_database, percentiles, write_results  # noqa: E402
from bench.component_server import PUBLISH  # noqa: E402
from bench.relay import listening_pid, server_pids, service_cpu  # noqa: E402

BENCH_DB = os.environ.get("RELAY_BENCH_HOSTILE_DB", "relay_bench_hostile")
STREAM_NS = "http://etherx.jabber.org/streams"
ACCEPT_NS = "jabber:component:accept"
STANZAS_NS = "urn:ietf:params:xml:ns:xmpp-stanzas"
STREAMS_NS = "urn:ietf:params:xml:ns:xmpp-streams"
COMPONENT = "push.bench"
SECRET = "bench-secret"
DOMAIN = "localhost"

NO_NODE_PUBLISH = PUBLISH.replace(" node='{node}'", "")
DISCO_VCARD = (
    "<iq type='get' from='{sender}' to='{component}' id='{id}'><vCard xmlns='vcard-temp'/></iq>"
)
COMMAND_NO_FORM = (
    "<iq type='set' from='{sender}' to='{component}' id='{id}'>"
    "<command xmlns='http://jabber.org/protocol/commands' action='execute' "
    "node='register-push-fcm'/></iq>"
)
COMMAND = (
    "<iq type='set' from='{sender}' to='{component}' id='{id}'>"
    "<command xmlns='http://jabber.org/protocol/commands' action='execute' "
    "node='register-push-fcm'><x xmlns='jabber:x:data' type='submit'>"
    "<field var='token'><value>t</value></field><field var='device-id'><value>d</value></field>"
    "</x></command></iq>"
)


def hostile_kinds(real_node: str) -> list[tuple[str, str]]:
    """(kind, template) of each hostile stanza; {id} is filled in per stanza."""
    long_local = "a" * 3000 + "@" + DOMAIN

    def publish(sender: str, node: str, secret: str, body: str = "New Message!") -> str:
        return PUBLISH.format(
            domain=sender, component=COMPONENT, id="{id}", node=node, secret=secret
        ).replace("New Message!", body)

    return [
        ("publish_from_not_a_jid", publish("@@@", real_node, "s")),
        ("publish_from_a@b@c", publish("a@b@c", real_node, "s")),
        (
            "command_from_3000_char_localpart",
            COMMAND.format(sender=long_local, component=COMPONENT, id="{id}"),
        ),
        (
            "publish_without_node",
            NO_NODE_PUBLISH.format(domain=DOMAIN, component=COMPONENT, id="{id}", secret="s"),
        ),
        ("publish_5000_char_body", publish(DOMAIN, real_node, "s", body="y" * 5000)),
        ("publish_unknown_node", publish(DOMAIN, "{unknown}", "s")),
        ("publish_wrong_secret", publish(DOMAIN, real_node, "wrong-secret")),
        ("get_vcard", DISCO_VCARD.format(sender=DOMAIN, component=COMPONENT, id="{id}")),
        ("publish_from_full_jid", publish(DOMAIN + "/res", real_node, "s")),
        (
            "command_without_form",
            COMMAND_NO_FORM.format(sender="eve@" + DOMAIN + "/x", component=COMPONENT, id="{id}"),
        ),
    ]


class ServerEnd:
    """Accepts the gateway's component connections one after another; records every answer
    (by iq id: arrival time, type, error condition), the stream errors it received, and the
    raw bytes received after each bad input."""

    def __init__(self) -> None:
        self.port = 0
        self.handshakes: list[float] = []
        self.answers: dict[str, tuple[float, str, str]] = {}
        self.stream_errors: list[str] = []
        self.not_well_formed_from_gateway = 0
        self.received_after_mark = bytearray()
        self.marking = False
        self._writer: asyncio.StreamWriter | None = None
        self._connected = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None
        self.changed = asyncio.Event()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def wait_handshakes(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.handshakes) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"only {len(self.handshakes)} of {count} handshakes")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)

    @property
    def writer(self) -> asyncio.StreamWriter:
        assert self._writer is not None
        return self._writer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = ET.XMLPullParser(("start", "end"))
        stream_id = secrets.token_hex(8)
        depth = 0
        try:
            while data := await reader.read(262144):
                if self.marking:
                    self.received_after_mark += data
                parser.feed(data)
                for event, element in parser.read_events():
                    if event == "start":
                        depth += 1
                        if depth == 1:
                            header = (
                                f"<?xml version='1.0'?><stream:stream xmlns:stream='{STREAM_NS}'"
                                f" xmlns='{ACCEPT_NS}' from='{COMPONENT}' id='{stream_id}'>"
                            )
                            writer.write(header.encode())
                        continue
                    depth -= 1
                    if depth != 1:
                        continue
                    self._stanza(element, stream_id, writer)
                    element.clear()
        except ET.ParseError:
            self.not_well_formed_from_gateway += 1
        except OSError:
            pass
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            self.changed.set()

    def _stanza(self, element: ET.Element, stream_id: str, writer: asyncio.StreamWriter) -> None:
        tag = element.tag
        if tag == f"{{{ACCEPT_NS}}}handshake":
            expected = hashlib.sha1((stream_id + SECRET).encode()).hexdigest()
            assert (element.text or "").strip() == expected, "wrong handshake"
            writer.write(b"<handshake/>")
            self._writer = writer
            self.handshakes.append(time.perf_counter())
            self.changed.set()
        elif tag == f"{{{STREAM_NS}}}error":
            conditions = [
                c.tag.split("}")[1] for c in element if c.tag.startswith(f"{{{STREAMS_NS}}}")
            ]
            self.stream_errors.append(next((c for c in conditions if c != "text"), ""))
            self.changed.set()
        elif tag == f"{{{ACCEPT_NS}}}iq":
            condition = ""
            if element.get("type") == "error":
                error = element.find(f"{{{ACCEPT_NS}}}error")
                if error is not None:
                    names = [
                        c.tag.split("}")[1] for c in error if c.tag.startswith(f"{{{STANZAS_NS}}}")
                    ]
                    condition = f"{error.get('type')}/" + next(
                        (n for n in names if n != "text"), ""
                    )
            self.answers[element.get("id", "")] = (
                time.perf_counter(),
                element.get("type", ""),
                condition,
            )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs so far (from /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


async def flood_phase(
    args: argparse.Namespace, server: ServerEnd, nodes: list[tuple[str, str]], gateway_pid: int
) -> dict[str, Any]:
    kinds = hostile_kinds(nodes[0][0])
    good_sent: dict[str, float] = {}
    hostile_ids: dict[str, str] = {}
    flood_started = asyncio.Event()
    flood_done = asyncio.Event()
    stop_good = asyncio.Event()
    baseline_ids: list[str] = []
    flood_good_ids: list[str] = []

    async def good_publishes() -> None:
        interval = 1.0 / args.good_rate
        count = 0
        next_at = time.perf_counter()
        while not stop_good.is_set():
            node, secret = nodes[1 + count % (len(nodes) - 1)]
            iq_id = f"good-{count}"
            count += 1
            (flood_good_ids if flood_started.is_set() else baseline_ids).append(iq_id)
            good_sent[iq_id] = time.perf_counter()
            server.writer.write(
                PUBLISH.format(
                    domain=DOMAIN, component=COMPONENT, id=iq_id, node=node, secret=secret
                ).encode()
            )
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    async def flood() -> None:
        await asyncio.sleep(args.baseline_seconds)
        flood_started.set()
        chunk: list[str] = []
        for number in range(args.hostile):
            kind, template = kinds[number % len(kinds)]
            iq_id = f"h-{number}"
            hostile_ids[iq_id] = kind
            chunk.append(
                template.replace("{id}", iq_id).replace("{unknown}", uuid.uuid4().hex[:12])
            )
            if len(chunk) >= 50:
                server.writer.write("".join(chunk).encode())
                chunk = []
                await server.writer.drain()
        if chunk:
            server.writer.write("".join(chunk).encode())
            await server.writer.drain()
        flood_done.set()

    cpu_pids = {"gateway": gateway_pid}
    servers = {
        "postgres": server_pids(os.environ["DATABASE_URL"], "")["postgres"],
        "redis-server": listening_pid(urlsplit(os.environ["RELAY_STATE_URL"]).port or 6379),
    }
    cpu_before = service_cpu(cpu_pids, servers)
    busy_before = machine_busy()
    started = time.perf_counter()
    good = asyncio.create_task(good_publishes())
    await flood()
    sent_all = time.perf_counter()
    # Wait for the answers to the flood (or give up), valid publishes still flowing.
    deadline = time.monotonic() + args.answer_timeout
    while time.monotonic() < deadline:
        if all(i in server.answers for i in hostile_ids):
            break
        await asyncio.sleep(0.1)
    flood_answered = time.perf_counter()
    await asyncio.sleep(1.0)
    stop_good.set()
    await good
    await asyncio.sleep(2.0)  # the last valid publishes' answers
    finished = time.perf_counter()
    cpu_after = service_cpu(cpu_pids, servers)
    busy_after = machine_busy()

    def latencies(ids: list[str]) -> list[float]:
        return [server.answers[i][0] - good_sent[i] for i in ids if i in server.answers]

    def answer_types(ids: list[str]) -> dict[str, int]:
        return dict(
            Counter(
                (
                    server.answers[i][1]
                    + (" " + server.answers[i][2] if server.answers[i][2] else "")
                )
                if i in server.answers
                else "unanswered"
                for i in ids
            )
        )

    hostile_answers: dict[str, Counter[str]] = {kind: Counter() for kind, _ in kinds}
    for iq_id, kind in hostile_ids.items():
        answer = server.answers.get(iq_id)
        hostile_answers[kind][(answer[2] or answer[1]) if answer else "unanswered"] += 1
    stanzas = len(hostile_ids) + len(baseline_ids) + len(flood_good_ids)
    unanswered = sum(1 for i in hostile_ids if i not in server.answers)
    return {
        "hostile_stanzas": len(hostile_ids),
        "valid_publishes": {"before_flood": len(baseline_ids), "during_flood": len(flood_good_ids)},
        "valid_rate_per_second": args.good_rate,
        "flood_write_seconds": round(sent_all - started - args.baseline_seconds, 2),
        "flood_answered_seconds": round(flood_answered - started - args.baseline_seconds, 2),
        "hostile_unanswered": unanswered,
        "hostile_answers_by_kind": {
            kind: dict(counter) for kind, counter in hostile_answers.items()
        },
        "valid_answers_before_flood": answer_types(baseline_ids),
        "valid_answers_during_flood": answer_types(flood_good_ids),
        "latency_ms_valid_before_flood": percentiles(latencies(baseline_ids)),
        "latency_ms_valid_during_flood": percentiles(latencies(flood_good_ids)),
        "gateway_cpu_seconds": round(cpu_after["gateway"] - cpu_before["gateway"], 2),
        "gateway_cpu_us_per_stanza": round(
            (cpu_after["gateway"] - cpu_before["gateway"]) * 1e6 / stanzas, 1
        ),
        "cpu_seconds_postgres_redis": {
            name: round(cpu_after[name] - cpu_before[name], 2)
            for name in ("postgres", "redis-server")
        },
        "machine_busy_fraction": round(
            (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1]), 2
        ),
        "loadavg_1min_after": round(os.getloadavg()[0], 2),
        "seconds": round(finished - started, 1),
    }


async def drops_phase(args: argparse.Namespace, server: ServerEnd) -> dict[str, Any]:
    reconnect: list[float] = []
    echoed = 0
    marker = b"ECHO-MARKER-" + secrets.token_hex(6).encode()
    for _ in range(args.drops):
        count = len(server.handshakes)
        server.received_after_mark = bytearray()
        server.marking = True
        bad = b"<iq type='set' id='" + marker + b"'><unclosed " + marker + b"></iq>"
        sent = time.perf_counter()
        server.writer.write(bad)
        await server.wait_handshakes(count + 1, timeout=120)
        server.marking = False
        reconnect.append(server.handshakes[-1] - sent)
        echoed += marker in bytes(server.received_after_mark)
    return {
        "drops": args.drops,
        "reconnect_seconds_after_each_drop": [round(s, 2) for s in reconnect],
        "stream_errors_received": dict(Counter(server.stream_errors)),
        "gateway_streams_not_well_formed": server.not_well_formed_from_gateway,
        "drops_that_echoed_input": echoed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hostile", type=int, default=52000, help="hostile stanzas in the flood")
    parser.add_argument("--good-rate", type=float, default=50.0, help="valid publishes per second")
    parser.add_argument("--registrations", type=int, default=200)
    parser.add_argument("--baseline-seconds", type=float, default=3.0)
    parser.add_argument("--answer-timeout", type=float, default=60.0)
    parser.add_argument("--drops", type=int, default=6)
    parser.add_argument("--label", default="", help="stored in the JSON (e.g. before/after)")
    args = parser.parse_args()

    # The production default log level: logging is a cost too. The gateway queues its sends
    # (no worker runs): what is measured is its answer, not a send.
    django_on_fresh_database(BENCH_DB, log_level="INFO", RELAY_DIRECT_SEND_SHARE="0")
    from relay.identifiers import new_node, new_secret
    from relay.models import App, Component, Registration, Service, Tenant
    from tests.support import broker

    broker.purge()
    log_path = Path(tempfile.mkstemp(prefix="bench-hostile-gateway-", suffix=".log")[1])
    gateway: subprocess.Popen[bytes] | None = None

    async def run() -> dict[str, Any]:
        nonlocal gateway
        server = ServerEnd()
        await server.start()

        def setup() -> list[tuple[str, str]]:
            tenant = Tenant.objects.create(name="bench")
            app = App.objects.create(tenant=tenant, name="bench")
            component = Component.objects.create(
                tenant=tenant,
                app=app,
                jid=COMPONENT,
                secret=SECRET,
                host="127.0.0.1",
                port=server.port,
            )
            rows = [
                Registration(
                    app=app,
                    component=component,
                    service=Service.FCM,
                    device_hash=f"{i:040x}",
                    account_domain=DOMAIN,
                    token=f"bench-token-{i}",
                    node=new_node(),
                    secret=new_secret(),
                )
                for i in range(args.registrations)
            ]
            Registration.objects.bulk_create(rows)
            return [(row.node, row.secret) for row in rows]

        nodes = await asyncio.to_thread(setup)
        env = dict(os.environ, RELAY_COMPONENT_POLL_SECONDS="0.5", PYTHONUNBUFFERED="1")
        with log_path.open("wb") as log_file:
            gateway = subprocess.Popen(
                [sys.executable, "manage.py", "run_gateway"],
                cwd=ROOT,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        await server.wait_handshakes(1, timeout=60)
        await asyncio.sleep(1.0)
        results = {"flood": await flood_phase(args, server, nodes, gateway.pid)}
        results["drops"] = await drops_phase(args, server)
        await server.close()
        return results

    try:
        results = asyncio.run(run())
    finally:
        if gateway is not None:
            gateway.terminate()
            try:
                gateway.wait(15)
            except subprocess.TimeoutExpired:
                gateway.kill()
        broker.purge()
    log_text = log_path.read_text(errors="replace")
    errors = [line for line in log_text.splitlines() if '"level": "ERROR"' in line]
    results["gateway_log"] = {
        "lines": log_text.count("\n"),
        "error_lines": len(errors),
        "error_events": dict(
            Counter(
                json.loads(line).get("event", "")[:60] for line in errors if line.startswith("{")
            )
        ),
        "bytes": len(log_text),
    }
    results.update(
        {
            "benchmark": "hostile",
            "label": args.label,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "log_level": os.environ["LOG_LEVEL"],
        }
    )
    log_path.unlink()
    write_results("hostile", results)


if __name__ == "__main__":
    main()
