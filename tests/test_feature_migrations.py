"""The feature apps took their data from the core without losing any: each migration is run
backwards to the core's old state, rows are written there, and forwards again."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import date

import pytest
from django.apps.registry import Apps
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = [pytest.mark.defaults, pytest.mark.django_db(transaction=True)]


def _migrate(targets: list[tuple[str, str | None]]) -> Apps:
    """The database migrated to `targets`; the models as they were there."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    executor = MigrationExecutor(connection)
    return executor.loader.project_state([t for t in targets if t[1] is not None]).apps


@pytest.fixture
def back_to() -> Iterator[object]:
    """Migrates back for a test, and forwards to the newest state after it (whatever failed)."""
    try:
        yield _migrate
    finally:
        _forwards()


def _forwards() -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())


def test_windows_devices_move_to_their_app_with_their_rows_and_registrations(back_to):
    old = back_to([("relay", "0013_unifiedpush_reports"), ("windows", None)])
    tenant = old.get_model("relay", "Tenant").objects.create(name="acme")
    app = old.get_model("relay", "App").objects.create(tenant=tenant, name="uwpx")
    component = old.get_model("relay", "Component").objects.create(
        tenant=tenant, app=app, jid="push.acme.example", secret="x"
    )
    device = old.get_model("relay", "WnsDevice").objects.create(
        app=app, device_id_hash="d" * 64, channel_uri="https://db5.notify.windows.com/?token=1"
    )
    registration = old.get_model("relay", "Registration").objects.create(
        app=app, component=component, service="wns", wns_device=device, device_hash="h" * 64,
        account_domain="acme.example", token=device.channel_uri, node="n1", secret="s1",
    )  # fmt: skip
    content_types = old.get_model("contenttypes", "ContentType")
    content_types.objects.get_or_create(app_label="relay", model="wnsdevice")

    _forwards()

    from django.contrib.contenttypes.models import ContentType

    from relay.models import Registration
    from relay.windows.models import WnsDevice

    moved = WnsDevice.objects.get()
    assert (moved.pk, moved.app_id, moved.device_id_hash) == (device.pk, app.pk, "d" * 64)
    assert moved.channel_uri == "https://db5.notify.windows.com/?token=1"
    assert Registration.objects.get(pk=registration.pk).wns_account.device == moved
    assert ContentType.objects.filter(app_label="windows", model="wnsdevice").exists()
    assert not ContentType.objects.filter(app_label="relay", model="wnsdevice").exists()


BEFORE_WNS_ACCOUNTS = [("relay", "0018_webpush"), ("windows", "0001_initial")]


def test_a_windows_devices_accounts_move_from_the_registration_to_the_windows_app_and_back(
    back_to,
):
    old = back_to(BEFORE_WNS_ACCOUNTS)
    tenant = old.get_model("relay", "Tenant").objects.create(name="acme")
    app = old.get_model("relay", "App").objects.create(tenant=tenant, name="uwpx")
    component = old.get_model("relay", "Component").objects.create(
        tenant=tenant, app=app, jid="push.acme.example", secret="x"
    )
    devices = old.get_model("windows", "WnsDevice").objects
    first = devices.create(
        app=app, device_id_hash="d" * 64, channel_uri="https://a.notify.windows.com/"
    )
    second = devices.create(
        app=app, device_id_hash="e" * 64, channel_uri="https://b.notify.windows.com/"
    )
    registrations = old.get_model("relay", "Registration").objects

    def registration(node: str, device: object) -> int:
        return registrations.create(
            app=app, component=component, service="wns", wns_device=device, device_hash=node * 64,
            account_domain="acme.example", token="https://a.notify.windows.com/", node=node,
            secret="s",
        ).pk  # fmt: skip

    owned = {registration("a", first): first.pk, registration("b", first): first.pk}
    owned[registration("c", second)] = second.pk
    elsewhere = registration("x", None)  # registered over XMPP, no device

    _forwards()

    from relay.models import Registration
    from relay.windows.models import WnsAccount

    assert dict(WnsAccount.objects.values_list("registration_id", "device_id")) == owned
    assert Registration.objects.count() == 4
    assert not WnsAccount.objects.filter(registration_id=elsewhere).exists()
    assert "wns_device" not in {field.name for field in Registration._meta.get_fields()}

    back = back_to(BEFORE_WNS_ACCOUNTS)
    restored = back.get_model("relay", "Registration").objects
    assert dict(restored.filter(pk__in=owned).values_list("pk", "wns_device_id")) == owned
    assert restored.get(pk=elsewhere).wns_device_id is None


BEFORE_UNIFIEDPUSH_SETTINGS = [
    ("relay", "0015_component_serves_something_leaves_the_database"),
    ("unifiedpush", "0001_initial"),
]


def test_unifiedpush_settings_move_to_their_app_and_back(back_to):
    old = back_to(BEFORE_UNIFIEDPUSH_SETTINGS)
    tenant = old.get_model("relay", "Tenant").objects.create(name="acme")
    app = old.get_model("relay", "App").objects.create(tenant=tenant, name="conversations")
    components = old.get_model("relay", "Component").objects
    up = components.create(
        tenant=tenant, jid="up.acme.example", secret="x",
        unifiedpush_endpoint_url="https://push.acme.example", unifiedpush_token_lifetime_days=14,
    )  # fmt: skip
    both = components.create(
        tenant=tenant, app=app, jid="both.acme.example", secret="x",
        unifiedpush_endpoint_url="https://push.acme.example/relay/",
    )  # fmt: skip
    p2 = components.create(tenant=tenant, app=app, jid="p2.acme.example", secret="x")

    _forwards()

    from relay.models import Component
    from relay.unifiedpush.models import ComponentSettings, serves

    rows = {
        row.component_id: (row.endpoint_url, row.token_lifetime_days)
        for row in ComponentSettings.objects.all()
    }
    assert rows == {
        up.pk: ("https://push.acme.example", 14),
        both.pk: ("https://push.acme.example/relay/", 7),
    }
    assert not serves(Component.objects.get(pk=p2.pk))  # no row: today's default, none
    assert {f.name for f in Component._meta.get_fields()}.isdisjoint(
        {"unifiedpush_endpoint_url", "unifiedpush_token_lifetime_days"}
    )

    # Undone, the values are the component's columns again.
    old = _migrate(BEFORE_UNIFIEDPUSH_SETTINGS)
    back = {
        c.pk: (c.unifiedpush_endpoint_url, c.unifiedpush_token_lifetime_days)
        for c in old.get_model("relay", "Component").objects.all()
    }
    assert back == {
        up.pk: ("https://push.acme.example", 14),
        both.pk: ("https://push.acme.example/relay/", 7),
        p2.pk: ("", 7),
    }


def test_unifiedpush_reports_move_to_their_app_with_their_rows(back_to):
    old = back_to([("relay", "0018_webpush"), ("unifiedpush", "0002_componentsettings")])
    day = date(2026, 11, 30)
    row = old.get_model("relay", "ReportUnifiedPush").objects.create(
        day=day, tenant_id=7, tenant_name="acme", component_id=3,
        component_name="up.acme.example", received=12, delivered=10, expired=2,
        bytes_relayed=4096,
    )  # fmt: skip
    content_types = old.get_model("contenttypes", "ContentType")
    content_types.objects.get_or_create(app_label="relay", model="reportunifiedpush")

    _forwards()

    from django.contrib.contenttypes.models import ContentType

    from relay.unifiedpush.models import ReportUnifiedPush

    assert ReportUnifiedPush._meta.app_label == "unifiedpush"
    assert ReportUnifiedPush._meta.db_table == "relay_reportunifiedpush"
    moved = ReportUnifiedPush.objects.get()
    assert (moved.pk, moved.day, moved.tenant_id, moved.tenant_name) == (row.pk, day, 7, "acme")
    assert (moved.component_name, moved.received, moved.delivered, moved.expired) == (
        "up.acme.example", 12, 10, 2,
    )  # fmt: skip
    assert moved.bytes_relayed == 4096
    assert ContentType.objects.filter(app_label="unifiedpush", model="reportunifiedpush").exists()
    assert not ContentType.objects.filter(app_label="relay", model="reportunifiedpush").exists()
