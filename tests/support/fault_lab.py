"""The lab of the fault tests (tests/test_faults*.py): faults mid-stream, no push answered
`result` lost, and the relay recovering by itself.

Each test runs the real gateway and two real Celery workers against a PostgreSQL, a RabbitMQ
(a virtual host of its own on a private node, or a private three-node cluster) and a Redis
(state only) of its own, plays
the users' XMPP server at the other end of the component link (publishes at a steady rate,
one per registration, so every publish is one push we can follow), sends through the real
firebase-admin client to the FCM fake, and breaks something a few seconds in:

- PostgreSQL restarted (`pg_ctl stop -m fast`, a few seconds down);
- the RabbitMQ node restarted (SIGTERM, a few seconds down);
- a worker killed with SIGKILL while sends are in flight, repeatedly;
- in a three-node cluster, one node killed with SIGKILL and its data directory deleted (the
  host is gone), then replaced by an empty node that joins the cluster;
- the whole broker down for 20 s (the gateway sends what it can itself and answers `wait`
  for what it cannot).

Where the path matters, a fault is tried on both: `direct`, the product's defaults, where the
gateway sends an everyday push itself (relay/services/direct_sends.py) and the broker carries
only what it does not; and `workers` (RELAY_DIRECT_SEND_SHARE=0), every send through the broker
and the workers, as on a busy gateway. A test about the workers themselves runs on `workers`.

Then it waits until every accepted push is delivered or dead-lettered and reports (prints
and asserts): publishes answered `result`, pushes delivered (seen by the fake, unique
push ids), dead letters, lost (must be 0), duplicates (the same push id twice: allowed,
at-least-once) and the recovery time: from the moment the service is back (or the worker is
killed) until a push published after that moment reaches FCM, and until the backlog drained.

The tests are in three modules, so that `make test`'s slices can share them out:
tests/test_faults.py (a server restarted, the whole broker down), tests/test_faults_workers.py
(the workers killed, a stuck provider, a lone tenant's burst, no beat) and
tests/test_faults_cluster.py (a RabbitMQ cluster node lost). Each module starts its own private
servers (the `fault_servers` fixture, module-scoped). Loaded as a plugin by tests/conftest.py:
the fixtures `fault_lab` and `fault_cluster_lab`.

The processes and the assertions use the private database (created from a migrated template
for each test, read back with psycopg); the test process's own Django database is not used.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kombu import Connection

from bench.component_server import PUBLISH
from tests.fakes.fcm import FakeFcm
from tests.support.component_server import FakeXmppServer
from tests.support.processes import (
    ROOT,
    ServiceProcess,
    beat_argv,
    service_env,
    start_gateway,
    worker_argv,
)
from tests.support.provider_fakes import configure
from tests.support.rabbitmq import PrivateRabbit, PrivateRabbitCluster
from tests.support.services import PrivatePostgres, PrivateRedis
from tests.support.waiting import wait_until

SECRET = "fault-secret"
SEND_QUEUE = "relay.sends"  # CELERY_QUEUE's default
TEMPLATE_DB = "relay_template"
# Offered load and length of each stream: a few hundred pushes, a fault a few seconds in.
RATE = 40.0
PUBLISHES = 360
FAULT_AFTER = 2.0
# Publishes sent at once just before the fault, so that the workers are busy when it hits.
BURST = 120
WORKERS = 2
WORKER_THREADS = 16
KILLS = 3
DRAIN_TIMEOUT = 90.0
PROVIDER_TIMEOUT = 5.0  # RELAY_PROVIDER_TIMEOUT_SECONDS's default
# The send paths (the module's docstring): the settings each starts the processes with.
PATHS: dict[str, dict[str, str]] = {"direct": {}, "workers": {"RELAY_DIRECT_SEND_SHARE": "0"}}
BOTH_PATHS = pytest.mark.parametrize("path", list(PATHS))


# --- the private servers, shared by the module; a fresh database for each test


Servers = tuple[PrivatePostgres, PrivateRedis, PrivateRabbit]


@pytest.fixture(scope="module")
def fault_servers() -> Iterator[Servers]:
    with PrivatePostgres() as postgres, PrivateRedis() as redis, PrivateRabbit() as rabbit:
        postgres.create_database(TEMPLATE_DB)
        _run_django(postgres.url(TEMPLATE_DB), "migrate")
        yield postgres, redis, rabbit


_DATABASES = iter(range(1, 1000))


def _run_django(database_url: str, action: str, spec: dict[str, Any] | None = None) -> None:
    """Migrate or seed the private database in a process of its own (Django set up for it)."""
    code = (
        "import sys, json; from tests.support.fault_lab import _django_main; "
        f"_django_main({action!r})"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=service_env(DATABASE_URL=database_url, LOG_LEVEL="WARNING"),
        input=json.dumps(spec or {}),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _django_main(action: str) -> None:
    """In the helper process: `migrate`, or `seed` the tenants read as JSON from stdin."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
    django.setup()
    if action == "migrate":
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        return
    from relay.models import App, Component, Registration, Service, Tenant

    for spec in json.load(sys.stdin)["tenants"]:
        tenant = Tenant.objects.create(name=spec["name"])
        app = App.objects.create(
            tenant=tenant,
            name="app",
            payload_options={"fcm": {"push_id_key": "push_id"}},  # the push id on the wire
        )
        configure(
            app,
            "fcm",
            service_account=json.dumps(spec["service_account"]),
            endpoint=spec["fcm_url"],
        )
        component = Component.objects.create(
            tenant=tenant, app=app, jid=spec["jid"], secret=SECRET, port=spec["port"]
        )
        Registration.objects.bulk_create(
            Registration(
                app=app,
                component=component,
                service=Service.FCM,
                device_hash=f"{i:040x}",
                account_domain="localhost",
                token=token(spec["name"], i),
                node=node(spec["name"], i),
                secret=SECRET,
            )
            for i in range(spec["registrations"])
        )


def token(tenant: str, i: int) -> str:
    return f"{tenant}-token-{i}"


def node(tenant: str, i: int) -> str:
    return f"{tenant}-node-{i}"


# --- the XMPP server's end of the link, publishing at a steady rate


class _Stamped(list):  # type: ignore[type-arg]
    """The fake server's stanza list, noting when each answer arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.times: dict[str, float] = {}

    def append(self, element: ET.Element) -> None:
        self.times.setdefault(element.get("id", ""), time.time())
        super().append(element)


@dataclass
class Tenant:
    """One tenant: its FCM fake, its XMPP server and what its stream published."""

    name: str
    fcm: FakeFcm
    server: FakeXmppServer
    registrations: int
    sent: dict[str, float] = field(default_factory=dict)  # iq id -> when
    not_sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def jid(self) -> str:
        return f"push.{self.name}.localhost"

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "jid": self.jid,
            "port": self.server.port,
            "fcm_url": self.fcm.url,
            "service_account": self.fcm.service_account(f"project-{self.name}"),
            "registrations": self.registrations,
        }

    def publish_stream(self, count: int, rate: float | None, *, start: int = 0) -> None:
        """Publish to registrations start..start+count-1, `rate` per second (None: at once;
        the link may be down for a moment: a publish not written counts as not sent)."""
        begin = time.monotonic()
        for n in range(count):
            delay = begin + n / rate - time.monotonic() if rate else 0
            if delay > 0:
                time.sleep(delay)
            i = start + n
            iq_id = f"{self.name}-{i}"
            xml = PUBLISH.format(
                domain="localhost",
                component=self.jid,
                id=iq_id,
                node=node(self.name, i),
                secret=SECRET,
            )
            with self._lock:
                try:
                    self.server.send(xml)
                except OSError:
                    self.not_sent += 1
                    continue
                self.sent[iq_id] = time.time()

    def answers(self) -> dict[str, tuple[str, float]]:
        """iq id -> (type, when) of the answers received so far."""
        stanzas: _Stamped = self.server.stanzas  # type: ignore[assignment]
        return {
            stanza.get("id", ""): (stanza.get("type", ""), stanzas.times[stanza.get("id", "")])
            for stanza in list(stanzas)
            if stanza.get("id", "") in self.sent
        }

    def accepted(self) -> dict[str, float]:
        """token -> when its publish was sent, for publishes answered `result`."""
        return {
            token(self.name, int(iq_id.rsplit("-", 1)[1])): self.sent[iq_id]
            for iq_id, (kind, _) in self.answers().items()
            if kind == "result"
        }

    def delivered(self) -> dict[str, list[tuple[str, float]]]:
        """token -> [(push id, when)] of the sends the fake answered 200."""
        found: dict[str, list[tuple[str, float]]] = {}
        for request in self.fcm.requests:
            if request.status == 200 and request.token:
                push_id = request.message.get("data", {}).get("push_id", "")
                found.setdefault(request.token, []).append((push_id, request.time))
        return found


class Lab:
    """The private servers, one fresh database, the FCM fakes, the gateway and the workers."""

    def __init__(
        self,
        postgres: PrivatePostgres,
        redis: PrivateRedis,
        rabbit: PrivateRabbit | None = None,
        *,
        broker_url: str = "",
    ) -> None:
        self.postgres = postgres
        self.redis = redis
        self.rabbit = rabbit
        self.database = f"relay_fault_{next(_DATABASES)}"
        if rabbit is not None:  # a virtual host of its own: no queue left by another test
            rabbit.ctl("add_vhost", self.database)
            rabbit.ctl("set_permissions", "-p", self.database, "guest", ".*", ".*", ".*")
            broker_url = rabbit.url(self.database)
        self.broker_url = broker_url
        postgres.psql(f'CREATE DATABASE "{self.database}" TEMPLATE "{TEMPLATE_DB}"')
        self.database_url = postgres.url(self.database)
        self.tenants: dict[str, Tenant] = {}
        self.gateway: ServiceProcess | None = None
        self.beat: ServiceProcess | None = None
        self.workers: list[ServiceProcess] = []
        self.env: dict[str, str] = {}
        redis_cli(redis, "FLUSHALL")

    def add_tenant(self, name: str, registrations: int) -> Tenant:
        fcm = FakeFcm().start()
        server = FakeXmppServer(f"push.{name}.localhost", SECRET)
        server.stanzas = _Stamped()
        tenant = self.tenants[name] = Tenant(name, fcm, server, registrations)
        return tenant

    def start(self, *, workers: int = WORKERS, beat: bool = True, **env: str) -> None:
        _run_django(
            self.database_url, "seed", {"tenants": [t.spec() for t in self.tenants.values()]}
        )
        self.env = {
            "DATABASE_URL": self.database_url,
            "CELERY_BROKER_URL": self.broker_url,
            "RELAY_STATE_URL": self.redis.url(0),
            "CACHE_URL": self.redis.url(1),
            **env,
        }
        self.gateway = start_gateway(**self.env)
        for _ in range(workers):
            self.start_worker()
        if beat:  # housekeeping only: the workers themselves queue the deferred sends
            schedule = str(Path(tempfile.mkdtemp(prefix="relay-beat-")) / "schedule")
            self.beat = ServiceProcess("beat", beat_argv(schedule), service_env(**self.env))
        for tenant in self.tenants.values():
            tenant.server.wait_connected(gateway=self.gateway)

    def start_worker(self) -> ServiceProcess:
        worker = ServiceProcess(
            f"worker-{len(self.workers)}",
            worker_argv(concurrency=WORKER_THREADS),
            service_env(**self.env),
        )
        self.workers.append(worker)
        return worker

    def close(self) -> str:
        """Stop everything; returns the processes' logs (the tail) for failure messages."""
        logs = []
        for process in [self.gateway, self.beat, *self.workers]:
            if process is not None:
                process.stop()
                logs.append(f"--- {process.name}\n{process.log_text()[-4000:]}")
        for tenant in self.tenants.values():
            tenant.server.close()
            tenant.fcm.stop()
        with contextlib.suppress(Exception):
            self.postgres.psql(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
        return "\n".join(logs)

    def ready_in_queue(self) -> int:
        """Sends ready in the broker's send queue (not those delivered, unacknowledged)."""
        with Connection(self.broker_url.split(";")[0]) as connection:
            queue = connection.default_channel.queue_declare(SEND_QUEUE, passive=True)
            return int(queue.message_count)

    # --- reading the outcome back

    def _by_token(self, table: str, column: str) -> dict[str, str]:
        with psycopg.connect(self.database_url) as db:
            rows = db.execute(
                f"SELECT r.token, t.{column} FROM {table} t"
                " JOIN relay_registration r ON r.id = t.registration_id"
            ).fetchall()
        return dict(rows)

    def dead_letters(self) -> dict[str, str]:
        """token -> reason."""
        return self._by_token("relay_deadletter", "reason")

    def delivery_rows(self) -> dict[str, str]:
        """token -> outcome of its Delivery row."""
        return self._by_token("relay_delivery", "outcome")

    def settled(self) -> bool:
        """Every accepted push reached FCM or is a dead letter, and has its Delivery row."""
        accepted: set[str] = set()
        delivered: set[str] = set()
        for tenant in self.tenants.values():
            accepted |= set(tenant.accepted())
            delivered |= set(tenant.delivered())
        dead = set(self.dead_letters())
        rows = set(self.delivery_rows())
        return accepted <= (delivered | dead) and (delivered | dead) <= rows


def redis_cli(redis: PrivateRedis, *args: str) -> str:
    result = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(redis.port), *args],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return result.stdout.strip()


@pytest.fixture
def fault_lab(fault_servers: Servers) -> Iterator[Lab]:
    postgres, redis, rabbit = fault_servers
    if not postgres.running():
        postgres.start()
    if not rabbit.running():
        rabbit.start()
    lab = Lab(postgres, redis, rabbit)
    lab.logs = ""
    try:
        yield lab
    finally:
        lab.logs = lab.close()


# --- the report


@dataclass
class Report:
    fault: str
    answered_result: int
    delivered: int
    dead_letters: dict[str, int]
    lost: int
    duplicates: int
    without_delivery_row: int
    recovery_seconds: float
    drain_seconds: float
    answered_wait: int
    lost_sent_at: list[float] = field(default_factory=list)  # when each was published

    def line(self) -> str:
        dead = ", ".join(f"{n} {reason}" for reason, n in self.dead_letters.items()) or "0"
        return (
            f"FAULT {self.fault}: {self.answered_result} answered result "
            f"({self.answered_wait} answered wait), {self.delivered} delivered, "
            f"dead letters: {dead}, lost {self.lost}, {self.duplicates} sent twice, "
            f"{self.without_delivery_row} without a Delivery row; recovery "
            f"{self.recovery_seconds:.1f} s, backlog drained {self.drain_seconds:.1f} s"
            + (f"; lost ones published at {self.lost_sent_at[:5]}" if self.lost_sent_at else "")
        )


def report(lab: Lab, tenant: Tenant, fault: str, back_at: float) -> Report:
    """Count what happened to the tenant's stream; `back_at`: when the fault ended."""
    accepted = tenant.accepted()
    delivered = tenant.delivered()
    dead = lab.dead_letters()
    rows = lab.delivery_rows()
    lost = {t for t in accepted if t not in delivered and t not in dead}
    after = [
        min(when for _, when in delivered[t])
        for t, sent in accepted.items()
        if sent >= back_at and t in delivered
    ]
    ends = [min(when for _, when in sends) for sends in delivered.values()]
    duplicates = sum(1 for sends in delivered.values() if len(sends) > 1)
    return Report(
        fault=fault,
        answered_result=len(accepted),
        answered_wait=sum(1 for kind, _ in tenant.answers().values() if kind == "error"),
        delivered=len(delivered),
        dead_letters=dict(Counter(dead[t] for t in accepted if t in dead)),
        lost=len(lost),
        duplicates=duplicates,
        without_delivery_row=sum(1 for t in delivered if t not in rows),
        recovery_seconds=(min(after) - back_at) if after else float("inf"),
        drain_seconds=max(0.0, max(ends) - back_at) if ends else float("inf"),
        lost_sent_at=sorted(accepted[t] for t in lost),
    )


def worker_delivered_after(worker: ServiceProcess, offset: int) -> int:
    """`delivery.done` lines with outcome delivered that a worker logged past `offset`."""
    count = 0
    with worker.log_path.open("rb") as log:
        log.seek(offset)
        for line in log:
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if entry.get("event") == "delivery.done" and entry.get("outcome") == "delivered":
                    count += 1
    return count


def worker_logged_after(worker: ServiceProcess, offset: int, text: str) -> bool:
    with worker.log_path.open("rb") as log:
        log.seek(offset)
        return text.encode() in log.read()


def run_stream_with_fault(lab: Lab, tenant: Tenant, fault: Any) -> float:
    """Publish the tenant's stream, FAULT_AFTER seconds in a BURST at once and then call
    `fault()` (it returns when the fault is over), wait for every answer and for the pushes
    to settle; returns when the fault ended."""
    stream = threading.Thread(target=tenant.publish_stream, args=(PUBLISHES, RATE))
    stream.start()
    time.sleep(FAULT_AFTER)
    tenant.publish_stream(BURST, None, start=PUBLISHES)
    with contextlib.suppress(TimeoutError):  # the burst is queued: the workers are busy
        wait_until(lambda: len(tenant.answers()) >= len(tenant.sent) - 10, timeout=10)
    back_at = fault()
    stream.join()
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: len(tenant.answers()) >= len(tenant.sent), timeout=30, interval=0.5)
    with contextlib.suppress(TimeoutError):
        wait_until(lab.settled, timeout=DRAIN_TIMEOUT, interval=1.0)
    return back_at


def check(
    result: Report, lab: Lab, *, answered: int = PUBLISHES // 3, recovery: float = 30.0
) -> None:
    print(result.line())
    assert result.answered_result >= answered, result.line()
    assert result.lost == 0, f"{result.line()}\n{lab.close()}"
    assert result.without_delivery_row == 0, result.line()
    assert result.recovery_seconds < recovery, result.line()


def latencies(tenant: Tenant) -> list[float]:
    """Seconds from each accepted publish to its first send at the fake."""
    delivered = tenant.delivered()
    return sorted(
        min(when for _, when in delivered[t]) - sent
        for t, sent in tenant.accepted().items()
        if t in delivered
    )


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("inf")


def settle(lab: Lab) -> None:
    """Wait for every publish's answer, then for every accepted push to settle."""

    def answered() -> bool:
        return all(len(t.answers()) >= len(t.sent) for t in lab.tenants.values())

    with contextlib.suppress(TimeoutError):
        wait_until(answered, timeout=30, interval=0.5)
    with contextlib.suppress(TimeoutError):
        wait_until(lab.settled, timeout=DRAIN_TIMEOUT, interval=1.0)


def app_busy_after(worker: ServiceProcess, offset: int) -> int:
    """Sends a worker deferred for their app's busy threads (`delivery.app_busy`) past `offset`."""
    with worker.log_path.open("rb") as log:
        log.seek(offset)
        return sum(1 for line in log if b'"delivery.app_busy"' in line)


@pytest.fixture
def fault_cluster_lab(fault_servers: Servers) -> Iterator[tuple[Lab, PrivateRabbitCluster]]:
    postgres, redis, _ = fault_servers
    if not postgres.running():
        postgres.start()
    with PrivateRabbitCluster() as cluster:
        lab = Lab(postgres, redis, broker_url=cluster.url())
        lab.logs = ""
        try:
            yield lab, cluster
        finally:
            lab.logs = lab.close()
