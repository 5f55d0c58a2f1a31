"""Outages of the database and the broker: the publish answer must be `wait`, and recover.

These need servers to take away (PostgreSQL and Redis, as CI runs them), so they are not part
of the embedded-defaults run, where the database and the broker are files.
"""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.db import connection, transaction

from relay.models import LinkLease, Service
from relay.services.registrations import register_device
from tests.support import broker
from tests.support.component_server import FakeXmppServer, error_of
from tests.support.processes import start_gateway, test_database_url
from tests.support.proxy import TcpProxy
from tests.support.waiting import holds_for, wait_until
from tests.test_gateway_stanzas import COMPONENT, SECRET, Lab, make_component, publish_xml

pytestmark = pytest.mark.django_db(transaction=True)


def _proxied_database_url(proxy: TcpProxy) -> str:
    return test_database_url(host="127.0.0.1", port=proxy.port)


def test_database_outage_answers_wait_and_recovers(transactional_db):
    db = settings.DATABASES["default"]
    proxy = TcpProxy(db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432))
    server = FakeXmppServer(COMPONENT, SECRET)
    component = make_component(server.port)
    registration = register_device(
        component=component, service=Service.FCM, bare_jid="a@localhost", device_id="d", token="t"
    )
    broker.purge()
    gateway = start_gateway(DATABASE_URL=_proxied_database_url(proxy))
    try:
        server.wait_connected(gateway=gateway)
        lab = Lab(server, gateway, component, registration)
        assert lab.publish().get("type") == "result"
        proxy.cut()
        assert error_of(lab.publish()) == ("wait", "internal-server-error")
        proxy.restore()
        wait_until(lambda: lab.publish().get("type") == "result", interval=0.5)
    finally:
        assert gateway.stop() == 0
        server.close()
        proxy.close()
        broker.purge()


def test_broker_outage_answers_wait_and_recovers(transactional_db):
    url = urlsplit(settings.CELERY_BROKER_URL)
    proxy = TcpProxy(url.hostname or "127.0.0.1", url.port or 5672)
    server = FakeXmppServer(COMPONENT, SECRET)
    component = make_component(server.port)
    registration = register_device(
        component=component, service=Service.FCM, bare_jid="a@localhost", device_id="d", token="t"
    )
    broker.purge()
    # Every publish a send of its own (no coalescing, which keeps a repeat in the database),
    # and each through the broker (not the gateway's own sends, which need none).
    gateway = start_gateway(
        CELERY_BROKER_URL=broker.through(proxy.port),
        RELAY_COALESCE_SECONDS="0",
        RELAY_DIRECT_SEND_SHARE="0",
    )
    try:
        server.wait_connected(gateway=gateway)
        lab = Lab(server, gateway, component, registration)
        assert lab.publish().get("type") == "result"
        proxy.cut()
        assert error_of(lab.publish()) == ("wait", "internal-server-error")
        proxy.restore()
        wait_until(lambda: lab.publish().get("type") == "result", interval=0.5)
        assert len(broker.queued_jobs()) >= 2
    finally:
        assert gateway.stop() == 0
        server.close()
        proxy.close()
        broker.purge()


def test_a_link_holds_at_most_its_cap_of_requests_and_answers_bad_input_meanwhile(
    transactional_db,
):
    """With the registrations table locked, publishes wait for the database: the first
    RELAY_LINK_MAX_IN_FLIGHT of them wait, the rest are answered `wait` at once, and hostile
    stanzas are answered without touching the database or the gateway's threads."""
    server = FakeXmppServer(COMPONENT, SECRET)
    component = make_component(server.port)
    registration = register_device(
        component=component, service=Service.FCM, bare_jid="a@localhost", device_id="d", token="t"
    )
    broker.purge()
    gateway = start_gateway(RELAY_LINK_MAX_IN_FLIGHT="3")
    try:
        server.wait_connected(gateway=gateway)
        lab = Lab(server, gateway, component, registration)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("LOCK TABLE relay_registration IN ACCESS EXCLUSIVE MODE")
            server.send(
                "".join(publish_xml(f"p{i}", lab.node, lab.secret) for i in range(10))
                + publish_xml("bad-sender", lab.node, lab.secret, sender="@@@")
                + publish_xml("no-node", None, lab.secret)
            )
            for i in range(3, 10):
                assert error_of(server.reply_to(f"p{i}")) == ("wait", "resource-constraint")
            assert error_of(server.reply_to("bad-sender")) == ("modify", "jid-malformed")
            assert error_of(server.reply_to("no-node")) == ("modify", "bad-request")
            answered = {stanza.get("id") for stanza in server.stanzas}
            assert not {"p0", "p1", "p2"} & answered  # still waiting for the database
        for i in range(3):  # the lock is gone: they go through
            assert server.reply_to(f"p{i}").get("type") == "result"
    finally:
        assert gateway.stop() == 0
        server.close()
        broker.purge()


def test_a_gateway_cut_off_from_the_database_drops_its_link_before_its_lease_expires(
    transactional_db,
):
    """Another gateway may take the link once the lease expired in the database's clock: the
    holder, unable to renew, must have closed it by then (docs/production.md, "Scaling out")."""
    db = settings.DATABASES["default"]
    proxy = TcpProxy(db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432))
    server = FakeXmppServer(COMPONENT, SECRET)
    component = make_component(server.port)
    gateway = start_gateway(
        DATABASE_URL=_proxied_database_url(proxy),
        RELAY_GATEWAY_LEASE_SECONDS="5",
        RELAY_GATEWAY_RENEW_SECONDS="1",
    )
    try:
        server.wait_connected(gateway=gateway)
        wait_until(
            lambda: LinkLease.objects.filter(component=component).exclude(holder="").exists()
        )
        proxy.cut()
        cut_at = datetime.now(UTC)
        wait_until(lambda: server.closed_connections >= 1, timeout=15, interval=0.02)
        dropped_at = datetime.now(UTC)
        lease = LinkLease.objects.get(component=component)  # read past the proxy
        print(
            f"\nlink dropped {(dropped_at - cut_at).total_seconds():.1f}s after the cut,"
            f" {(lease.expires - dropped_at).total_seconds():.1f}s before its lease expired"
        )
        assert dropped_at < lease.expires
        holds_for(lambda: server.connections == 1, 1.0, "no new link without a lease")
        proxy.restore()
        server.wait_connected(count=2, timeout=20)  # the lease is taken again, the link back
    finally:
        assert gateway.stop() == 0
        server.close()
        proxy.close()
    assert "link.lease_lost" in gateway.log_text()
