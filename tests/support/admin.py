"""Building blocks for the admin tests: a tenant with one of everything, and its users.

A test module uses the `admin_settings` fixture by importing it by name.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.db import models
from django.utils import timezone

from relay.identifiers import new_node, new_secret
from relay.models import (
    App,
    Component,
    ComponentLink,
    DeadLetter,
    Delivery,
    LinkState,
    Outcome,
    Priority,
    Registration,
    Service,
    Tenant,
    TenantStaffGroup,
)
from relay.operators.models import AuditAction, AuditEntry, TenantSecurityPolicy
from relay.services import tenancy
from relay.services.queue import SendJob
from relay.unifiedpush.models import UnifiedPushDelivery
from tests.support.provider_fakes import configure

STRONG_PASSWORD = "correct horse battery staple 42"


@dataclass
class TenantWorld:
    """One tenant with an app, a component and its link, a registration, a delivery, a dead
    letter and a staff group; every name contains `marker` so a page can be searched for it."""

    marker: str
    tenant: Tenant
    app: App
    component: Component
    link: ComponentLink
    registration: Registration
    delivery: Delivery
    dead_letter: DeadLetter
    group: Group
    binding: TenantStaffGroup
    objects: dict[type[models.Model], list[models.Model]] = field(default_factory=dict)


def build_tenant(marker: str) -> TenantWorld:
    tenant = Tenant.objects.create(name=marker, display_name=f"{marker.title()} Hosting")
    app = App.objects.create(
        tenant=tenant,
        name=f"{marker}-app",
    )
    # Stored as is (no validation here): only its never being shown matters.
    configure(app, "fcm", service_account=f'{{"private_key": "{marker}-private-key-material"}}')
    configure(app, "wns", package_sid=f"ms-app://{marker}", secret=f"{marker}-wns-client-secret")
    component = Component.objects.create(
        tenant=tenant,
        app=app,
        jid=f"push.{marker}.example",
        secret=f"{marker}-component-secret-0123456789",
        host=f"xmpp.{marker}.example",
        port=5347,
    )
    now = timezone.now()
    link = ComponentLink.objects.create(
        component=component,
        state=LinkState.DOWN,
        since=now,
        last_error=f"{marker} wrong secret (not-authorized)",
        last_error_at=now,
    )
    registration = Registration.objects.create(
        app=app,
        component=component,
        service=Service.FCM,
        device_hash=hashlib.sha1(f"{marker}-device".encode()).hexdigest(),
        account_domain=f"{marker}.example",
        token=f"{marker}-fcm-token",
        node=new_node(),
        secret=new_secret(),
    )
    delivery = Delivery.objects.create(
        tenant=tenant,
        app=app,
        registration=registration,
        provider=Service.FCM,
        publishing_domain=f"{marker}.example",
        priority=Priority.HIGH,
        received=now - timedelta(minutes=5),
        queued=now - timedelta(minutes=5),
        sent=now - timedelta(minutes=5),
        outcome=Outcome.DELIVERED,
        error_code=f"{marker.upper()}_CODE",
    )
    dead_push_id = uuid.uuid4()
    dead_letter = DeadLetter.objects.create(
        push_id=dead_push_id,
        tenant=tenant,
        app=app,
        registration=registration,
        provider=Service.FCM,
        reason=f"{marker}-exhausted",
        attempts=8,
        job=SendJob(
            push_id=str(dead_push_id),
            registration_id=registration.pk,
            publishing_domain=f"{marker}.example",
            important=True,
            received=(now - timedelta(hours=1)).isoformat(),
        ).to_message(),
    )
    unifiedpush_delivery = UnifiedPushDelivery.objects.create(
        tenant=tenant,
        component=component,
        outcome="delivered",
        urgency=2,
        received=now - timedelta(minutes=3),
        finished=now - timedelta(minutes=3),
        size=len(marker) * 100,
        ttl=60,
    )
    group = tenancy.create_staff_group(tenant=tenant, name=f"{marker} staff")
    binding = TenantStaffGroup.objects.get(group=group)
    audit_entry = AuditEntry.objects.create(
        at=now,
        actor=f"{marker}-actor",
        action=AuditAction.CHANGED,
        object_type="relay.tenant",
        object_id=str(tenant.pk),
        object_repr=f"{marker} tenant",
        tenant=tenant,
    )
    policy = TenantSecurityPolicy.objects.create(tenant=tenant, second_factor_required=True)
    world = TenantWorld(
        marker=marker,
        tenant=tenant,
        app=app,
        component=component,
        link=link,
        registration=registration,
        delivery=delivery,
        dead_letter=dead_letter,
        group=group,
        binding=binding,
    )
    for obj in (
        tenant, app, component, link, registration, delivery, dead_letter, binding,
        unifiedpush_delivery, audit_entry, policy,
    ):  # fmt: skip
        world.objects.setdefault(type(obj), []).append(obj)
    return world


def make_tenant_staff(world: TenantWorld, username: str, *, every_permission: bool) -> User:
    """A staff user in the tenant's group; optionally with every permission there is, to show
    that the tenant binding alone confines them."""
    user = User.objects.create_user(username, password=STRONG_PASSWORD, is_staff=True)
    user.groups.add(world.group)
    if every_permission:
        world.group.permissions.set(Permission.objects.all())
    return user


def make_operator(username: str = "operator") -> User:
    return User.objects.create_superuser(username, password=STRONG_PASSWORD)


def login_verified(client: Any, user: User) -> None:
    """`client.force_login(user)` past the second step too: the user gets a recovery-code
    device (made before the login, as adding a device ends the user's other sessions) and
    the session is marked verified by it, as django-otp's own login does."""
    from django_otp import DEVICE_ID_SESSION_KEY
    from django_otp.plugins.otp_static.models import StaticDevice

    device, _ = StaticDevice.objects.get_or_create(user=user, name="test login")
    client.force_login(user)
    session = client.session
    session[DEVICE_ID_SESSION_KEY] = device.persistent_id
    session.save()


@pytest.fixture
def admin_settings(settings: Any) -> None:
    """Plain static storage (the manifest one needs `collectstatic`, which tests do not run)
    and a fast password hasher (the real one takes a good part of a second per login)."""
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _field_value(bound: Any) -> Any:
    value = bound.value()
    if value is None:
        return None
    if isinstance(value, bool):
        return "on" if value else None
    if isinstance(value, list | tuple):
        return [str(item) for item in value]
    if isinstance(value, dict):
        import json

        return json.dumps(value)
    return str(value)


def _form_data(form: Any, data: dict[str, Any]) -> None:
    for name in form.fields:
        value = _field_value(form[name])
        if value is not None:
            data[form.add_prefix(name)] = value


def changeform_data(response: Any, **changes: Any) -> dict[str, Any]:
    """What the browser would post back from an admin add/change page, with `changes`.

    Covers the main form and every inline formset (management forms included).
    """
    data: dict[str, Any] = {}
    _form_data(response.context["adminform"].form, data)
    for inline in response.context.get("inline_admin_formsets", []):
        formset = inline.formset
        _form_data(formset.management_form, data)
        for form in formset.forms:
            _form_data(form, data)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data
