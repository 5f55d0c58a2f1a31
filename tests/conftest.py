"""Shared fixtures: a tenant with an app and a component, and a clean send queue."""

from __future__ import annotations

import pytest

from relay.models import App, Component, Tenant
from tests.support import broker


@pytest.fixture
def component(db) -> Component:
    tenant = Tenant.objects.create(name="example")
    app = App.objects.create(tenant=tenant, name="conversations")
    return Component.objects.create(
        tenant=tenant, app=app, jid="push.localhost", secret="s3cr3t", host="127.0.0.1", port=5347
    )


@pytest.fixture
def send_queue():
    """The real broker's send queue, empty before and after the test."""
    broker.purge()
    yield broker
    broker.purge()
