"""The operator's admin, page by page: onboarding, audit, policy, registrations, deliveries,
usage, health, and the safety of logins and sessions."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from relay.models import (
    App,
    Component,
    ComponentLink,
    Delivery,
    LinkState,
    Outcome,
    Priority,
    Registration,
    Service,
    Tenant,
)
from relay.services import link_leases, usage
from relay.services.credentials import records
from relay.services.registrations import register_device
from tests.fakes.fcm import make_service_account
from tests.support.admin import (
    admin_settings,  # noqa: F401 -- fixture
    build_tenant,
    changeform_data,
    login_verified,
    make_operator,
    make_tenant_staff,
)

pytestmark = [
    pytest.mark.defaults,
    pytest.mark.django_db,
    pytest.mark.usefixtures("admin_settings"),
]

ROOT = Path(__file__).resolve().parent.parent
# An asset fetched from anywhere but this site (the admin must work offline).
FOREIGN_ASSET = re.compile(
    r"""(?:src|href|action)\s*=\s*["'](?:https?:)?//|url\(\s*["']?(?:https?:)?//"""
)


@pytest.fixture
def operator(db):
    return make_operator()


@pytest.fixture
def client(operator) -> Client:
    client = Client()
    login_verified(client, operator)
    return client


def post_form(client: Client, url: str, **changes: object):
    """GET the admin form, then post it back with `changes`, as a browser would."""
    page = client.get(url)
    assert page.status_code == 200, url
    return client.post(url, changeform_data(page, **changes))


def onboard(client: Client, name: str = "acme") -> tuple[Tenant, App, Component]:
    response = post_form(
        client,
        reverse("admin:relay_tenant_add"),
        name=name,
        display_name=f"{name.title()} Hosting",
        allowed_domains=f"{name}.example\nchat.{name}.example",
    )
    tenant = Tenant.objects.get(name=name)
    assert response.status_code == 302
    assert response.url == reverse("admin:relay_tenant_change", args=[tenant.pk])
    tenant_page = client.get(response.url).content.decode()
    add_app = reverse("admin:relay_app_add") + f"?tenant={tenant.pk}"
    assert add_app in tenant_page

    service_account = make_service_account("http://127.0.0.1:9/token", project_id=f"{name}-prj")
    response = post_form(
        client,
        add_app,
        name="conversations",
        fcm_service_account=json.dumps(service_account),
        fcm_endpoint="http://127.0.0.1:9",
    )
    assert response.status_code == 302, response.context["adminform"].form.errors
    assert response.url == reverse("admin:relay_tenant_change", args=[tenant.pk])
    app = App.objects.get(tenant=tenant)
    assert json.loads(records.values_of(app, "fcm")["service_account"])["project_id"] == (
        f"{name}-prj"
    )

    add_component = reverse("admin:relay_component_add") + f"?tenant={tenant.pk}&app={app.pk}"
    assert add_component.replace("&", "&amp;") in client.get(response.url).content.decode()
    response = post_form(
        client, add_component, jid=f"push.{name}.example", host=f"xmpp.{name}.example"
    )
    component = Component.objects.get(tenant=tenant)
    assert response.status_code == 302
    assert response.url == reverse("admin:relay_component_change", args=[component.pk])
    return tenant, app, component


def test_onboarding_a_tenant_in_one_sitting(client, operator):
    tenant, app, component = onboard(client)
    # A strong generated secret, shown in both servers' configuration snippets.
    assert len(component.secret) >= 43 and component.app == app and component.enabled
    page = client.get(reverse("admin:relay_component_change", args=[component.pk]))
    text = page.content.decode()
    assert "Component &quot;push.acme.example&quot;" in text
    assert f"component_secret = &quot;{component.secret}&quot;" in text
    assert f"password: &quot;{component.secret}&quot;" in text
    assert "module: ejabberd_service" in text
    assert "component_ports = { 5347 }" in text
    # The secret input never renders it back.
    assert f'value="{component.secret}"' not in text
    # The tenant's page now shows its app, its component (link not yet tried) and a chart.
    tenant_page = client.get(reverse("admin:relay_tenant_change", args=[tenant.pk]))
    text = tenant_page.content.decode()
    assert "push.acme.example" in text and "conversations" in text and "<svg" in text
    assert "unknown" in text
    assert not FOREIGN_ASSET.search(text)
    # Every step is in the history, with who did it.
    added = LogEntry.objects.filter(action_flag=ADDITION, user=operator)
    assert {entry.object_repr for entry in added} >= {
        "Acme Hosting",
        "acme/conversations",
        component.jid,
    }


def test_component_secret_rules(client):
    _, _, component = onboard(client)
    url = reverse("admin:relay_component_change", args=[component.pk])
    old = component.secret
    # Empty keeps the secret; a weak or oddly-quoted one is refused.
    assert post_form(client, url, new_secret="").status_code == 302
    component.refresh_from_db()
    assert component.secret == old
    for weak in ("short", 'quote"in-it-is-not-allowed'):
        response = post_form(client, url, new_secret=weak)
        assert (
            response.status_code == 200
            and "new_secret" in response.context["adminform"].form.errors
        )
    # An app of another tenant is refused.
    other = build_tenant("other")
    response = post_form(client, url, app=other.app.pk)
    assert "app" in response.context["adminform"].form.errors


def test_credential_changes_are_recorded_without_the_secret(client, operator):
    _, app, component = onboard(client)
    new_account = make_service_account("http://127.0.0.1:9/token", project_id="rotated-prj")
    response = post_form(
        client,
        reverse("admin:relay_app_change", args=[app.pk]),
        fcm_service_account=json.dumps(new_account),
    )
    assert response.status_code == 302
    new_secret = "Operator-Chosen-Secret-1234567890"
    response = post_form(
        client, reverse("admin:relay_component_change", args=[component.pk]), new_secret=new_secret
    )
    assert response.status_code == 302
    component.refresh_from_db()
    assert component.secret == new_secret

    changes = LogEntry.objects.filter(action_flag=CHANGE, user=operator)
    messages = {entry.object_repr: entry.get_change_message() for entry in changes}
    assert "Service account JSON" in messages["acme/conversations"]
    assert "Secret" in messages[component.jid]
    private_key_line = new_account["private_key"].splitlines()[1]
    for url in (
        reverse("admin:relay_app_history", args=[app.pk]),
        reverse("admin:relay_component_history", args=[component.pk]),
        reverse("admin:admin_logentry_changelist"),
    ):
        text = client.get(url).content.decode()
        assert operator.username in text
        assert private_key_line not in text and new_secret not in text
    for entry in LogEntry.objects.all():
        assert private_key_line not in entry.change_message
        assert new_secret not in entry.change_message


def test_tenant_staff_never_read_a_credential(client):
    tenant, app, component = onboard(client)
    world = build_tenant("staffed")
    staff = make_tenant_staff(world, "staffer", every_permission=False)
    world.binding.tenant = tenant  # bind that group to acme instead
    world.binding.save()
    staff_client = Client()
    login_verified(staff_client, staff)
    page = staff_client.get(reverse("admin:relay_component_change", args=[component.pk]))
    assert page.status_code == 200
    text = page.content.decode()
    assert component.secret not in text
    assert "&lt;the component secret&gt;" in text
    app_page = staff_client.get(reverse("admin:relay_app_change", args=[app.pk])).content.decode()
    stored = json.loads(records.values_of(app, "fcm")["service_account"])
    assert stored["private_key"].splitlines()[1] not in app_page
    # The secret-regenerating action is the operator's.
    assert (
        "regenerate_secret"
        not in staff_client.get(reverse("admin:relay_component_changelist")).content.decode()
    )


def test_suspend_asks_for_confirmation_then_resume(client, operator):
    tenant, _, _ = onboard(client)
    changelist = reverse("admin:relay_tenant_changelist")
    first = client.post(
        changelist, {"action": "suspend", "index": "0", "_selected_action": [tenant.pk]}
    )
    assert first.status_code == 200
    assert "Suspend these tenants?" in first.content.decode()
    assert "registrations survive" in first.content.decode()
    tenant.refresh_from_db()
    assert not tenant.suspended
    confirmed = client.post(
        changelist, {"action": "suspend", "post": "yes", "_selected_action": [tenant.pk]}
    )
    assert confirmed.status_code == 302
    tenant.refresh_from_db()
    assert tenant.suspended
    assert "suspended" in client.get(changelist).content.decode()
    client.post(changelist, {"action": "resume", "index": "0", "_selected_action": [tenant.pk]})
    tenant.refresh_from_db()
    assert not tenant.suspended
    history = [
        e.get_change_message()
        for e in LogEntry.objects.filter(object_id=str(tenant.pk), action_flag=CHANGE)
    ]
    assert history.count("Changed Suspended.") == 2


def test_destructive_actions_ask_first(client):
    tenant, _, component = onboard(client)
    changelist = reverse("admin:relay_component_changelist")
    for action in ("disable", "regenerate_secret", "delete_selected"):
        page = client.post(
            changelist, {"action": action, "index": "0", "_selected_action": [component.pk]}
        )
        assert page.status_code == 200, action
        assert 'name="post" value="yes"' in page.content.decode(), action
    old_secret = component.secret
    component.refresh_from_db()
    assert component.enabled and component.secret == old_secret
    client.post(
        changelist, {"action": "disable", "post": "yes", "_selected_action": [component.pk]}
    )
    client.post(
        changelist,
        {"action": "regenerate_secret", "post": "yes", "_selected_action": [component.pk]},
    )
    component.refresh_from_db()
    assert not component.enabled and component.secret != old_secret and len(component.secret) >= 43
    delete_page = client.get(reverse("admin:relay_component_delete", args=[component.pk]))
    assert "Are you sure" in delete_page.content.decode()
    assert Component.objects.filter(pk=component.pk).exists()
    # A tenant goes only once its components are gone (an app in use is protected).
    delete_page = client.get(reverse("admin:relay_tenant_delete", args=[tenant.pk]))
    assert "Cannot delete tenant" in delete_page.content.decode()


def test_registrations_are_found_by_node_or_domain_never_by_jid(client, send_queue, operator):
    _, _, component = onboard(client)
    answer = register_device(
        component=component,
        service=Service.FCM,
        bare_jid="alice@acme.example",
        device_id="phone-1",
        token="fcm-token-of-alice",
    )
    registration = Registration.objects.get(node=answer.node)
    changelist = reverse("admin:relay_registration_changelist")

    def found(query: str) -> list[Registration]:
        return list(client.get(changelist, {"q": query}).context["cl"].result_list)

    assert found(answer.node) == [registration]
    assert found("acme.example") == [registration]
    assert found("alice@acme.example") == [] and found("alice") == []
    page = client.get(reverse("admin:relay_registration_change", args=[registration.pk]))
    text = page.content.decode()
    assert "fcm-token-of-alice" not in text and answer.secret not in text and "alice" not in text

    # A test push goes through the real queue, and is recorded.
    response = client.post(reverse("admin:relay_registration_test_push", args=[registration.pk]))
    assert response.status_code == 302
    [job] = send_queue.queued_jobs()
    assert job["registration_id"] == registration.pk and job["important"] is True
    entry = LogEntry.objects.get(object_id=str(registration.pk), action_flag=CHANGE)
    assert job["push_id"] in entry.get_change_message() and entry.user == operator
    # The registration's recent deliveries are on its page.
    Delivery.objects.create(
        push_id=uuid.UUID(job["push_id"]),
        tenant=component.tenant,
        app=component.app,
        registration=registration,
        provider=Service.FCM,
        publishing_domain="acme.example",
        priority=Priority.HIGH,
        received=timezone.now(),
        queued=timezone.now(),
        outcome=Outcome.DEAD_TOKEN,
        error_code="UNREGISTERED",
    )
    text = client.get(
        reverse("admin:relay_registration_change", args=[registration.pk])
    ).content.decode()
    assert "UNREGISTERED" in text and "dead token" in text


def add_delivery(
    tenant, app, *, provider=Service.FCM, outcome=Outcome.DELIVERED, age=timedelta(minutes=1)
):
    received = timezone.now() - age
    return Delivery.objects.create(
        tenant=tenant,
        app=app,
        provider=provider,
        publishing_domain=f"{tenant.name}.example",
        priority=Priority.HIGH,
        received=received,
        queued=received,
        outcome=outcome,
    )


def test_delivery_log_and_dead_letters_filter(client):
    one, two = build_tenant("one"), build_tenant("two")
    second_app = App.objects.create(tenant=one.tenant, name="one-ios")
    add_delivery(one.tenant, second_app, provider=Service.APNS, outcome=Outcome.FAILED)
    add_delivery(one.tenant, one.app, outcome=Outcome.DEAD_TOKEN, age=timedelta(days=3))
    changelist = reverse("admin:relay_delivery_changelist")

    def shown(**params: object) -> set[int]:
        response = client.get(changelist, params)
        assert response.status_code == 200, params
        return {delivery.pk for delivery in response.context["cl"].result_list}

    everything = set(Delivery.objects.values_list("pk", flat=True))
    assert shown() == everything
    assert shown(tenant__id__exact=one.tenant.pk) == set(
        Delivery.objects.filter(tenant=one.tenant).values_list("pk", flat=True)
    )
    assert shown(app__id__exact=second_app.pk) == set(
        Delivery.objects.filter(app=second_app).values_list("pk", flat=True)
    )
    assert shown(provider__exact="apns") == set(
        Delivery.objects.filter(provider="apns").values_list("pk", flat=True)
    )
    assert shown(outcome__exact="dead_token") == set(
        Delivery.objects.filter(outcome="dead_token").values_list("pk", flat=True)
    )
    # An aware moment, as the admin's own date filter links pass (a bare date is naive).
    since = (timezone.now() - timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    assert shown(received__gte=since.isoformat()) == set(
        Delivery.objects.filter(received__gte=since).values_list("pk", flat=True)
    )
    assert shown(received__gte=since.isoformat()) != everything
    # CSV export of a filtered list.
    response = client.post(
        changelist + "?outcome__exact=failed",
        {"action": "export_csv", "index": "0", "select_across": "1", "_selected_action": ["0"]},
    )
    lines = b"".join(response.streaming_content).decode().strip().splitlines()
    assert lines[0].startswith("push_id,tenant,app,provider")
    assert len(lines) == 2 and ",failed," in lines[1]

    dead = reverse("admin:relay_deadletter_changelist")
    for params, expected in (
        ({"tenant__id__exact": two.tenant.pk}, {two.dead_letter.pk}),
        ({"app__id__exact": one.app.pk}, {one.dead_letter.pk}),
        ({"provider__exact": "fcm"}, {one.dead_letter.pk, two.dead_letter.pk}),
        ({"reason": "one-exhausted"}, {one.dead_letter.pk}),
        ({"replayed__isempty": "1"}, {one.dead_letter.pk, two.dead_letter.pk}),
    ):
        result = client.get(dead, params).context["cl"].result_list
        assert {letter.pk for letter in result} == expected, params


def test_dead_letters_are_replayed_once_and_recorded(client, send_queue, operator):
    world = build_tenant("replay")
    letter = world.dead_letter
    changelist = reverse("admin:relay_deadletter_changelist")
    action = {"action": "replay", "index": "0", "_selected_action": [letter.pk]}
    response = client.post(changelist, action, follow=True)
    assert "Replayed 1 dead letter(s)" in response.content.decode()
    [job] = send_queue.queued_jobs()
    assert job["push_id"] == str(letter.push_id) and job["attempt"] == 1
    letter.refresh_from_db()
    assert letter.replayed is not None
    entry = LogEntry.objects.get(object_id=str(letter.pk))
    assert entry.user == operator and entry.get_change_message() == "Replayed."
    again = client.post(changelist, action, follow=True)
    assert "Replayed 0 dead letter(s) (1 already replayed)" in again.content.decode()
    assert send_queue.queued_jobs() == []


def test_usage_over_a_day_and_thirty_days_per_provider(client):
    world = build_tenant("usage")  # brings one delivered FCM push five minutes ago
    tenant, app = world.tenant, world.app
    add_delivery(tenant, app, outcome=Outcome.FAILED, age=timedelta(hours=2))
    add_delivery(tenant, app, outcome=Outcome.DEAD_TOKEN, age=timedelta(days=2))
    add_delivery(tenant, app, provider=Service.APNS, age=timedelta(days=10))
    add_delivery(tenant, app, age=timedelta(days=45))  # too old to count
    rows = {row.provider: row for row in usage.usage_table(tenant_ids=[tenant.pk])}
    assert rows["fcm"].day == usage.Counts(received=2, delivered=1, dead=0, failed=1)
    assert rows["fcm"].month == usage.Counts(received=3, delivered=1, dead=1, failed=1)
    assert rows["apns"].day == usage.Counts() and rows["apns"].month.delivered == 1
    days = usage.daily_counts(tenant_ids=[tenant.pk])
    assert len(days) == 30 and sum(d.counts.received for d in days) == 4

    for url in (
        reverse("admin:usage"),
        reverse("admin:relay_tenant_change", args=[tenant.pk]),
        reverse("admin:relay_app_change", args=[app.pk]),
    ):
        response = client.get(url)
        text = response.content.decode()
        assert "<svg" in text and "4 pushes in 30 days" in text, url
        assert not FOREIGN_ASSET.search(text), url
    tenants = client.get(reverse("admin:relay_tenant_changelist"))
    [row] = [t for t in tenants.context["cl"].result_list if t.pk == tenant.pk]
    assert row.day_count == 2


def test_health_page_and_probes(client, operator):
    world = build_tenant("health")
    ComponentLink.objects.filter(pk=world.link.pk).update(state=LinkState.UP)
    down = build_tenant("broken")  # its link is down with a wrong-secret error
    add_delivery(world.tenant, world.app, outcome=Outcome.FAILED)
    response = client.get(reverse("admin:health"))
    text = response.content.decode()
    links = {row.jid: row for row in response.context["links"].links}
    assert links[world.component.jid].state == "up"
    assert links[down.component.jid].last_error == "broken wrong secret (not-authorized)"
    assert "broken wrong secret (not-authorized)" in text
    assert response.context["links"].states["up"] == 1
    rates = {rate.provider: rate for rate in response.context["rates"]}
    assert rates["fcm"].counts.failed == 1 and rates["fcm"].failed_percent == pytest.approx(33.3)
    assert isinstance(response.context["queue_depth"], int)
    assert 'id="queue-depth"' in text
    # The component's own page says the same.
    component_page = client.get(reverse("admin:relay_component_change", args=[down.component.pk]))
    assert "broken wrong secret (not-authorized)" in component_page.content.decode()

    anonymous = Client()
    assert anonymous.get("/healthz").json() == {"status": "ok"}
    ready = anonymous.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {
        "database": True, "broker": True, "throttling": True, "cache": True
    }  # fmt: skip


def test_production_settings_pass_the_deploy_check(tmp_path):
    env = {
        **os.environ,
        "DEPLOYMENT": "production",
        "SECRET_KEY": Fernet.generate_key().decode() * 2,
        "ALLOWED_HOSTS": "push.example.org",
        "CREDENTIAL_KEYS": Fernet.generate_key().decode(),
        "UNIFIEDPUSH_KEYS": Fernet.generate_key().decode(),  # also 32 bytes, base64url
        "VAR_DIR": str(tmp_path),
    }
    env.pop("DEBUG", None)
    script = (
        "from django.conf import settings as s; from django.core.management import call_command; "
        "call_command('check', deploy=True, fail_level='WARNING'); "
        "print(s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SESSION_COOKIE_HTTPONLY, "
        "s.SECURE_SSL_REDIRECT, s.SECURE_HSTS_SECONDS > 0, s.SESSION_EXPIRE_AT_BROWSER_CLOSE)"
    )
    shown = subprocess.run(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert shown.stdout.splitlines()[-1].split() == ["True"] * 6, shown.stdout + shown.stderr


def test_the_operator_sees_the_gateways_and_which_holds_a_link_and_a_tenant_does_not(client):
    tenant, _app, component = onboard(client)
    changelist = reverse("admin:relay_component_changelist")
    change = reverse("admin:relay_component_change", args=[component.pk])
    assert "none (no gateway holds its lease)" in client.get(change).content.decode()
    link_leases.lease_round(gateway="gw-east/4242/abc123", ttl=30)
    health = reverse("admin:health")
    for url in (changelist, change, health):
        assert "gw-east/4242/abc123" in client.get(url).content.decode()
    assert re.search(r'id="gateways-live"><strong>1<', client.get(health).content.decode())
    world = build_tenant("staffed-gw")
    staff = make_tenant_staff(world, "staffer-gw", every_permission=False)
    world.binding.tenant = tenant
    world.binding.save()
    staff_client = Client()
    login_verified(staff_client, staff)
    for url in (changelist, change, health):
        page = staff_client.get(url)
        assert page.status_code == 200
        assert "gw-east" not in page.content.decode()
        assert 'id="gateways' not in page.content.decode()
    link_leases.leave(gateway="gw-east/4242/abc123")
    assert "gw-east" not in client.get(changelist).content.decode()
    assert "No gateway is running" in client.get(health).content.decode()
