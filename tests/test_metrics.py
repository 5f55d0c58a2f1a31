"""Watching the real processes: web with two worker processes, the gateway linked to a
real Prosody, the worker sending to a fake FCM. Each one's /metrics is scraped before and
after a register, a publish and some API requests, and the numbers must move by exactly what
was done: the web's counters added up over both web workers (each keeps its own file).

Then the gateway's and the worker's /readyz against a private PostgreSQL and Redis that are
stopped and started again: unready while either is away, ready once it is back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from pushsite.celery import app as celery_app
from relay.models import App, Component, ComponentLink, Tenant
from tests.fakes.fcm import FakeFcm
from tests.support.processes import (
    ROOT,
    probe_url,
    start_gateway,
    start_web,
    start_worker,
)
from tests.support.provider_fakes import configure
from tests.support.rabbitmq import PrivateRabbit
from tests.support.services import PrivatePostgres, PrivateRedis
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

DEVICE_ID = "92afd7a91cdba9a0"
API_REQUESTS = 40


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def post(url: str, body: bytes) -> int:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page by (name, sorted labels)."""
    status, text = get(base_url + "/metrics")
    assert status == 200, text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def fake_fcm():
    with FakeFcm() as fake:
        yield fake


@pytest.fixture
def processes(prosody, fake_fcm, tmp_path):
    component_jid, secret = prosody.components[0]
    tenant = Tenant.objects.create(name="acme")
    app = App.objects.create(
        tenant=tenant,
        name="conversations",
    )
    configure(
        app, "fcm", service_account=json.dumps(fake_fcm.service_account()), endpoint=fake_fcm.url
    )
    component = Component.objects.create(
        tenant=tenant,
        app=app,
        jid=component_jid,
        secret=secret,
        host="127.0.0.1",
        port=prosody.component_port,
    )
    metrics_dir = tmp_path / "web-metrics"
    started = []
    try:
        gateway = start_gateway()
        started.append(gateway)
        worker = start_worker()
        started.append(worker)
        web, web_url = start_web(workers=2, threads=4, WEB_METRICS_DIR=str(metrics_dir))
        started.append(web)
        wait_until(
            lambda: ComponentLink.objects.filter(component=component, state="up").exists(),
            timeout=30,
        )
        yield {
            "component": component,
            "gateway": probe_url(gateway),
            "worker": probe_url(worker),
            "web": web_url,
            "metrics_dir": metrics_dir,
        }
    finally:
        for process in started:
            process.stop()


def register(client, component: Component, token: str) -> tuple[str, str]:
    reply = client.execute_command(
        component.jid, "register-push-fcm", {"token": token, "device-id": DEVICE_ID}
    )
    command = reply.find("{http://jabber.org/protocol/commands}command")
    assert command is not None and command.get("status") == "completed", reply
    values = {
        field.get("var"): field.findtext("{jabber:x:data}value")
        for field in command.iter("{jabber:x:data}field")
    }
    return values["node"], values["secret"]


def per_worker_api_requests(metrics_dir: Path) -> list[float]:
    """The API requests each web worker counted in its own file."""
    counts = []
    for path in sorted(metrics_dir.glob("counter_*.db")):
        counts.append(
            sum(
                value
                for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path))
                if key.startswith('["relay_http_requests", "relay_http_requests_total"')
                and '"api"' in key
            )
        )
    return counts


def test_each_process_counts_what_it_did(processes, prosody, fake_fcm, xmpp_client_factory):
    component = processes["component"]
    gateway, worker, web = processes["gateway"], processes["worker"], processes["web"]
    tenant = str(component.tenant_id)

    # The link is up, and the gateway says so.
    assert get(gateway + "/readyz")[0] == 200
    before = {name: scrape(url) for name, url in (("gateway", gateway), ("worker", worker))}
    link = {"component": str(component.pk), "app": "conversations"}
    assert sample(before["gateway"], "relay_gateway_link_up", **link) == 1

    # A phone registers, enables push and goes away; a friend writes to it.
    phone = xmpp_client_factory(prosody, "phone")
    friend = xmpp_client_factory(prosody, "friend")
    token = "fcm-token-metrics"
    node, secret = register(phone, component, token)
    reply = phone.enable_push(component.jid, node, secret)
    assert reply.get("type") == "result", reply
    phone.disconnect()
    friend.send_message(phone.bare_jid, "wake up")
    fake_fcm.wait_for_requests(1, timeout=30)

    # The gateway sends an everyday push itself while it has CPU to spare, a worker when it
    # is busy: the one that sent it counts it, once; the gateway counts the publish's verdict
    # once it answered it (after the send, on its own path).
    accepted_before = sample(
        before["gateway"], "relay_publishes_total", tenant=tenant, verdict="accepted"
    )

    def moved() -> dict[str, dict] | None:
        samples = {"gateway": scrape(gateway), "worker": scrape(worker)}
        delivered = sum(
            sample(each, "relay_sends_total", provider="fcm", outcome="delivered")
            for each in samples.values()
        )
        accepted = sample(
            samples["gateway"], "relay_publishes_total", tenant=tenant, verdict="accepted"
        )
        return samples if delivered >= 1 and accepted >= accepted_before + 1 else None

    after = wait_until(moved, timeout=30)
    for name in ("relay_push_latency_seconds_count", "relay_send_duration_seconds_count"):
        assert sum(sample(each, name, provider="fcm") for each in after.values()) == 1, name
    for each in after.values():
        assert sample(each, "relay_sends_in_flight", provider="fcm") == 0
    assert sample(
        after["gateway"], "relay_registration_requests_total", tenant=tenant, result="created"
    ) == 1 + sample(
        before["gateway"], "relay_registration_requests_total", tenant=tenant, result="created"
    )

    # The web process: API requests spread over both web workers, added up by /metrics.
    labels = {"handler": "api", "method": "GET", "status": "200"}
    web_before = sample(scrape(web), "relay_http_requests_total", **labels)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(
            pool.map(lambda _: get(web + "/api/v1/openapi.json")[0], range(API_REQUESTS))
        )
    assert statuses == [200] * API_REQUESTS
    # Refused API requests are counted by the status they got.
    refused = [post(web + "/api/v1/apps/no-such-app/uwpx", b"{}") for _ in range(3)]
    assert all(status >= 400 for status in refused), refused
    web_after = scrape(web)
    assert sample(web_after, "relay_http_requests_total", **labels) == web_before + API_REQUESTS
    for status in set(refused):
        assert sample(
            web_after, "relay_http_requests_total", handler="api", method="POST", status=str(status)
        ) == refused.count(status)
    per_worker = per_worker_api_requests(processes["metrics_dir"])
    assert len(per_worker) == 2, per_worker  # one file per web worker
    api_total = sum(
        value
        for (name, labels_), value in web_after.items()
        if name == "relay_http_requests_total" and ("handler", "api") in labels_
    )
    assert api_total == web_before + API_REQUESTS + len(refused)
    assert sum(per_worker) == api_total  # /metrics is the sum of the workers' files
    assert all(count > 0 for count in per_worker), per_worker  # both served some
    # The stored state, read once by the web process.
    app = {"tenant": "acme", "app": "conversations", "provider": "fcm"}
    assert sample(web_after, "relay_registrations", **app, state="live") == 1
    assert sample(web_after, "relay_state_up", source="database") == 1
    assert sample(web_after, "relay_state_up", source="broker") == 1
    queue = str(celery_app.conf.task_default_queue)  # relay.sends on RabbitMQ
    assert ("relay_queue_depth", (("queue", queue),)) in web_after
    # No JID, token, node or secret in any label.
    for url in (gateway, worker, web):
        text = get(url + "/metrics")[1]
        for secret_text in (token, node, secret, phone.bare_jid, component.jid):
            assert secret_text not in text, (url, secret_text)


# --- readiness against a private database and broker -------------------------------------------


def migrate(database_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": database_url}
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v0"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=300,
    )


@pytest.fixture
def private_services():
    with PrivatePostgres() as postgres, PrivateRedis() as redis, PrivateRabbit() as rabbit:
        postgres.create_database("relay")
        migrate(postgres.url("relay"))
        yield postgres, redis, rabbit


def readiness(url: str) -> tuple[int, dict[str, bool]]:
    try:
        status, body = get(url + "/readyz", timeout=20)
    except OSError:
        return 0, {}
    return status, json.loads(body).get("checks", {})


def unready(url: str) -> dict[str, bool] | None:
    """The checks of a 503 answer, else None (still ready, or not answering)."""
    status, checks = readiness(url)
    return checks if status == 503 else None


def test_gateway_and_worker_go_unready_while_the_database_or_the_broker_is_down(
    private_services,
):
    postgres, redis, rabbit = private_services
    env = {
        "DATABASE_URL": postgres.url("relay"),
        "CELERY_BROKER_URL": rabbit.url(),
        "RELAY_STATE_URL": redis.url(0),
        "CACHE_URL": redis.url(1),
        "DATABASE_CONN_MAX_AGE": "0",
    }
    gateway = start_gateway(**env)
    worker = start_worker(**env)
    try:
        urls = {"gateway": probe_url(gateway), "worker": probe_url(worker)}

        def all_ready() -> bool:
            return all(readiness(url)[0] == 200 for url in urls.values())

        wait_until(all_ready, timeout=60)
        assert readiness(urls["gateway"])[1] == {"database": True, "broker": True, "links": True}
        assert readiness(urls["worker"])[1] == {"database": True, "broker": True}

        for stop, start, check in (
            (postgres.stop, postgres.start, "database"),
            (rabbit.stop, rabbit.start, "broker"),
        ):
            stop()
            for name, url in urls.items():
                checks = wait_until(lambda url=url: unready(url), timeout=60)
                assert checks[check] is False, (name, checks)
                # Liveness is not readiness: the process is alive and says so.
                assert get(url + "/healthz")[0] == 200
            start()
            wait_until(all_ready, timeout=90)
        assert gateway.alive() and worker.alive()
    finally:
        codes = {"gateway": gateway.stop(), "worker": worker.stop()}
    assert codes["gateway"] == 0, gateway.log_text()[-3000:]
