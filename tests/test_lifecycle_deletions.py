"""Every registration that disappears leaves a removal in the lifecycle log, whatever deletes
it, so the reports' `active` of past days stays right (docs/reports.md, Registrations).

Each way of deleting gets a registration created yesterday; after the deletion today, the
reports' own statement (analytics.sources.registration_sql, on PostgreSQL) must say it was
active at the end of yesterday and is gone at the end of today.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, timedelta
from itertools import count

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from analytics import reports, sources
from relay import tasks
from relay.models import App, Component, Registration, Service, Tenant
from relay.report_models import RegistrationEvent
from relay.services import lifecycle
from tests.support.admin import login_verified
from tests.support.unifiedpush_components import serving_unifiedpush

pytestmark = pytest.mark.django_db

_numbers = count(1)


def make_registration(*, app_free: bool = False, dead: bool = False) -> Registration:
    """A registration of a tenant of its own, its creation logged yesterday. `app_free`: its
    component names no app (it does not protect the app, so deleting the app or the tenant
    is what takes the registration)."""
    n = next(_numbers)
    tenant = Tenant.objects.create(name=f"tenant-{n}")
    app = App.objects.create(tenant=tenant, name=f"app-{n}")
    fields = {"tenant": tenant, "jid": f"push{n}.localhost", "secret": "s3cr3t"}
    if app_free:  # a component without an app serves UnifiedPush
        component = serving_unifiedpush(endpoint_url=f"https://up{n}.example", **fields)
    else:
        component = Component.objects.create(app=app, **fields)
    registration = Registration.objects.create(
        app=app,
        component=component,
        service=Service.FCM,
        device_hash=f"hash-{n}",
        account_domain="localhost",
        token=f"tok-{n}",
        node=f"node-{n}",
        secret="x",
    )
    yesterday = timezone.now() - timedelta(days=1)
    lifecycle.created([registration], at=yesterday)
    if dead:
        Registration.objects.filter(pk=registration.pk).update(dead_since=yesterday)
        lifecycle.died([registration.pk], at=yesterday)
    return registration


def active(registration: Registration, day: date) -> int:
    """The registrations report's `active` of `day` for the registration's tenant and app."""
    with connection.cursor() as cursor:
        cursor.execute(sources.registration_sql(day))
        names = [column.name for column in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    return sum(
        row["active"]
        for row in reports.registrations(rows, [day])
        if row["app_id"] == registration.app_id
    )


def by_admin(registration: Registration) -> None:
    client = Client()
    login_verified(client, User.objects.create_superuser(f"op{registration.pk}", password="x" * 24))
    url = reverse("admin:relay_registration_delete", args=[registration.pk])
    assert client.post(url, {"post": "yes"}).status_code == 302


def by_admin_action(registration: Registration) -> None:
    client = Client()
    login_verified(client, User.objects.create_superuser(f"op{registration.pk}", password="x" * 24))
    answer = client.post(
        reverse("admin:relay_registration_changelist"),
        {"action": "delete_selected", "_selected_action": [registration.pk], "post": "yes"},
    )
    assert answer.status_code == 302


def by_app(registration: Registration) -> None:
    App.objects.get(pk=registration.app_id).delete()


def by_tenant(registration: Registration) -> None:
    Tenant.objects.get(pk=registration.app.tenant_id).delete()


def by_component(registration: Registration) -> None:
    Component.objects.get(pk=registration.component_id).delete()


def by_cleanup_task(registration: Registration) -> None:
    Registration.objects.filter(pk=registration.pk).update(
        updated=timezone.now() - timedelta(days=365)
    )
    assert tasks.remove_unused_registrations() == 1


def by_queryset(registration: Registration) -> None:
    Registration.objects.filter(pk=registration.pk).delete()


def by_instance(registration: Registration) -> None:
    registration.delete()


WAYS: dict[str, Callable[[Registration], None]] = {
    "admin": by_admin,
    "admin action": by_admin_action,
    "app deleted": by_app,
    "tenant deleted": by_tenant,
    "component deleted (cascade)": by_component,
    "cleanup task": by_cleanup_task,
    "queryset delete()": by_queryset,
    "instance delete()": by_instance,
}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_deleted_registration_was_active_yesterday_and_is_gone_today(way):
    registration = make_registration(app_free=way in ("app deleted", "tenant deleted"))
    reg_id, app_id, tenant_id = registration.pk, registration.app_id, registration.app.tenant_id
    today = timezone.now().date()
    yesterday = today - timedelta(days=1)
    assert (active(registration, yesterday), active(registration, today)) == (1, 1)

    WAYS[way](registration)

    assert not Registration.objects.filter(pk=reg_id).exists()
    # One removal, never two (the cleanup task logs its own in one insert).
    removals = RegistrationEvent.objects.filter(registration_id=reg_id, kind="removed")
    assert list(removals.values_list("live_change", "app_id", "tenant_id")) == [
        (-1, app_id, tenant_id)
    ]
    assert (active(registration, yesterday), active(registration, today)) == (1, 0)


def test_deleting_a_dead_registration_changes_no_live_count():
    registration = make_registration(dead=True)
    today = timezone.now().date()
    reg_id = registration.pk
    registration.delete()
    removal = RegistrationEvent.objects.get(registration_id=reg_id, kind="removed")
    assert removal.live_change == 0
    assert active(registration, today - timedelta(days=1)) == 0


def test_a_deletion_rolled_back_logs_nothing():
    registration = make_registration()
    with pytest.raises(RuntimeError), transaction.atomic():
        Registration.objects.filter(pk=registration.pk).delete()
        raise RuntimeError("rolled back")
    assert Registration.objects.filter(pk=registration.pk).exists()
    assert not RegistrationEvent.objects.filter(kind="removed").exists()
