"""UnifiedPush when PostgreSQL goes away: the web process answers 503 (never 500, never a
201 for something not stored) and recovers by itself once the database is back; the gateway
reconnects its LISTEN and delivers what was stored meanwhile."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.support.component_server import FakeXmppServer
from tests.support.processes import ROOT, service_env, start_gateway, start_web
from tests.support.services import PrivatePostgres
from tests.support.waiting import wait_until

SETUP = """
import base64, os, time
from relay.models import Component, Tenant
from relay.unifiedpush.models import ComponentSettings
from relay.unifiedpush.services import registration
tenant = Tenant.objects.create(name="faults")
component = Component.objects.create(tenant=tenant, jid="up.localhost", secret="s3cr3t",
    host="127.0.0.1", port=int(os.environ["COMPONENT_PORT"]))
ComponentSettings.objects.create(component=component, endpoint_url=os.environ["WEB_URL"])
# A second component the web process has not read yet when the database goes (disabled
# once its endpoint exists: no link for the gateway to make).
unread = Component.objects.create(tenant=tenant, jid="up2.localhost", secret="s3cr3t")
ComponentSettings.objects.create(component=unread, endpoint_url=os.environ["WEB_URL"])
for each in (component, unread):
    print(registration.register(component_id=each.pk, jid="juliet@localhost/phone",
        domain="localhost", has_resource=True,
        application=base64.b64encode(os.urandom(32)).decode(),
        instance=base64.b64encode(os.urandom(32)).decode(), now=time.time()).endpoint)
Component.objects.filter(pk=unread.pk).update(enabled=False)
"""


def post(url: str, body: bytes) -> int:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def manage(database_url: str, *args: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=service_env(DATABASE_URL=database_url, **env),
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture
def postgres():
    with PrivatePostgres() as server:
        yield server


def test_a_database_restart_costs_some_503s_and_loses_nothing(postgres):
    database_url = postgres.create_database("up_faults")
    manage(database_url, "migrate", "--noinput")
    xmpp = FakeXmppServer("up.localhost", "s3cr3t")
    # 108 POSTs to one endpoint: more than its default burst on a quick machine; the rate
    # limit is not what this test is about.
    web, web_url = start_web(DATABASE_URL=database_url, RELAY_UNIFIEDPUSH_ENDPOINT_RATE="0/0")
    gateway = None
    try:
        endpoint, unread = (
            manage(
                database_url, "shell", "-c", SETUP, COMPONENT_PORT=str(xmpp.port), WEB_URL=web_url
            )
            .strip()
            .splitlines()[-2:]
        )
        gateway = start_gateway(DATABASE_URL=database_url, RELAY_UNIFIEDPUSH_SWEEP_SECONDS="0.5")
        xmpp.wait_connected(gateway=gateway)
        for n in range(40):  # every web thread now holds a database connection
            assert post(endpoint, f"before {n}".encode()) == 201
        postgres.stop()
        # A component whose state the web process has cached, and one whose state it must
        # read (as when its cached copy is stale): 503 for both, nothing stored.
        down = [post(endpoint, b"while down") for _ in range(8)]
        down += [post(unread, b"while down") for _ in range(8)]
        assert set(down) == {503}, down
        postgres.start()
        answers = [post(endpoint, f"after {n}".encode()) for n in range(60)]
        assert set(answers) <= {201, 503}, answers
        assert answers[-30:] == [201] * 30, answers  # every thread has recovered
        stored_after = sum(1 for code in answers if code == 201)
        pushes = xmpp.wait_for(
            lambda s: s.find("{http://gultsch.de/xmpp/drafts/unified-push}push") is not None,
            timeout=30,
            count=40 + stored_after,
        )
        assert len(pushes) == 40 + stored_after
        wait_until(lambda: '"unifiedpush.listening"' in gateway.log_text())
        assert "Traceback" not in web.log_text()
    finally:
        if gateway is not None:
            gateway.stop()
        web.stop()
        xmpp.close()
