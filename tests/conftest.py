"""Shared fixtures: a tenant with an app and a component, and a clean send queue."""

from __future__ import annotations

import pytest


@pytest.fixture
def component(db):
    from relay.models import App, Component, Tenant

    tenant = Tenant.objects.create(name="example")
    app = App.objects.create(tenant=tenant, name="conversations")
    return Component.objects.create(
        tenant=tenant, app=app, jid="push.localhost", secret="s3cr3t", host="127.0.0.1", port=5347
    )


@pytest.fixture
def send_queue():
    """The real broker's send queue, empty before and after the test."""
    from tests.support import broker

    broker.purge()
    yield broker
    broker.purge()


pytest_plugins = ["tests.support.fixtures", "tests.support.shards"]
