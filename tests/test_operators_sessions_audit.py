"""Admin sessions that end (idle, lifetime, everywhere, on a password or device change) and
the audit trail of every change, whatever made it: the admin, `load_tenants`,
`rotate_credentials`, the ORM; never a secret's value; CSV export; retention.

Session clocks are moved by rewriting the session's own stamps (as the lockout tests age
axes' failures), never by waiting.
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from django.contrib.auth.models import Group, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from relay.models import App, ProviderCredentials, Tenant
from relay.operators.models import AuditEntry
from relay.operators.services import sessions
from relay.services import retention
from tests.support.admin import (
    STRONG_PASSWORD,
    admin_settings,  # noqa: F401 -- fixture
    build_tenant,
    changeform_data,
    login_verified,
    make_operator,
    make_tenant_staff,
)
from tests.support.processes import ROOT, service_env

pytestmark = [pytest.mark.defaults, pytest.mark.usefixtures("admin_settings")]


def verified_client(user: User, address: str = "192.0.2.10") -> Client:
    browser = Client(REMOTE_ADDR=address)
    login_verified(browser, user)
    return browser


def shift_session(browser: Client, **seconds_ago: float) -> None:
    """Move the session's clocks (`started`, `seen`) into the past."""
    session = browser.session
    now = time.time()
    if "started" in seconds_ago:
        session[sessions.STARTED] = now - seconds_ago["started"]
    if "seen" in seconds_ago:
        session[sessions.SEEN] = now - seconds_ago["seen"]
    session.save()


def logged_out(browser: Client) -> bool:
    answer = browser.get("/admin/")
    return answer.status_code == 302 and answer["Location"].startswith(reverse("admin:login"))


# ------------------------------------------------------------------------------------ sessions
@pytest.mark.django_db
def test_an_idle_session_ends_and_a_used_one_goes_on(settings):
    settings.RELAY = {**settings.RELAY, "ADMIN_IDLE_SECONDS": 600}
    operator = make_operator()
    browser = verified_client(operator)
    shift_session(browser, seen=590)
    assert browser.get("/admin/").status_code == 200  # used within the limit: renewed
    shift_session(browser, seen=300)
    assert browser.get("/admin/").status_code == 200
    shift_session(browser, seen=601)
    assert logged_out(browser)
    entry = AuditEntry.objects.filter(action="logged_out").get()
    assert entry.detail == "idle timeout" and entry.object_repr == "operator"


@pytest.mark.django_db
def test_a_session_ends_at_its_lifetime_however_busy(settings):
    settings.RELAY = {**settings.RELAY, "ADMIN_SESSION_MAX_SECONDS": 3600}
    browser = verified_client(make_operator())
    shift_session(browser, started=3500, seen=1)
    assert browser.get("/admin/").status_code == 200
    shift_session(browser, started=3601, seen=1)
    assert logged_out(browser)
    assert AuditEntry.objects.get(action="logged_out").detail == "session lifetime reached"


@pytest.mark.django_db
def test_log_out_everywhere_keeps_only_the_session_that_asked():
    operator = make_operator()
    here, there = verified_client(operator), verified_client(operator, "198.51.100.3")
    answer = here.post(reverse("operators:security"), {"action": "end_sessions"})
    assert answer.status_code == 302
    assert here.get("/admin/").status_code == 200
    assert logged_out(there)
    entry = AuditEntry.objects.get(action="sessions_ended", detail="logged out everywhere")
    assert (entry.actor, entry.address, entry.detail) == (
        "operator",
        "192.0.2.10",
        "logged out everywhere",
    )


@pytest.mark.django_db
def test_an_operator_logs_a_staff_member_out_everywhere():
    alpha = build_tenant("alpha")
    staff = make_tenant_staff(alpha, "alpha-admin", every_permission=False)
    staff_browser = verified_client(staff, "198.51.100.4")
    assert staff_browser.get("/admin/").status_code == 200
    operator_browser = verified_client(make_operator())
    answer = operator_browser.post(
        "/admin/auth/user/", {"action": "end_sessions", "_selected_action": [staff.pk]}
    )
    assert answer.status_code == 302
    assert logged_out(staff_browser)
    assert operator_browser.get("/admin/").status_code == 200
    entry = AuditEntry.objects.get(action="sessions_ended", detail="ended by operator")
    assert entry.actor == "operator" and entry.object_repr == "alpha-admin"
    assert entry.tenant_id == alpha.tenant.pk  # the tenant's staff see it too


@pytest.mark.django_db
def test_a_password_change_ends_the_other_sessions():
    operator = make_operator()
    here, there = verified_client(operator), verified_client(operator, "198.51.100.5")
    new_password = "another long passphrase 77"
    answer = here.post(
        reverse("admin:password_change"),
        {
            "old_password": STRONG_PASSWORD,
            "new_password1": new_password,
            "new_password2": new_password,
        },
    )
    assert answer.status_code == 302, answer.content.decode()[:400]
    assert here.get("/admin/").status_code == 200
    assert logged_out(there)
    entry = AuditEntry.objects.get(action="changed", object_type="auth.user")
    assert entry.fields == ["password"] and entry.actor == "operator"


@pytest.mark.django_db
def test_a_new_device_ends_the_other_sessions():
    from tests.support.otp import totp

    operator = make_operator()
    here, there = verified_client(operator), verified_client(operator, "198.51.100.6")
    import re

    page = here.get(reverse("operators:enrol")).content.decode()
    secret = re.search(r'id="totp-secret">([A-Z2-7]+)<', page).group(1)
    answer = here.post(reverse("operators:enrol"), {"code": totp(secret), "name": "second"})
    assert answer.status_code == 302  # not a first device: back to the security page
    assert here.get(reverse("operators:security")).status_code == 200
    assert logged_out(there)


# ------------------------------------------------------------------------------------- audit
@pytest.mark.django_db
def test_admin_changes_name_fields_never_values():
    world = build_tenant("alpha")
    ProviderCredentials.objects.filter(app=world.app, service="fcm").delete()  # not a valid one
    operator = make_operator()
    browser = verified_client(operator, "203.0.113.9")
    url = reverse("admin:relay_app_change", args=[world.app.pk])
    secret = "wns-secret-that-must-never-appear"
    data = changeform_data(
        browser.get(url), wns_secret=secret, wns_package_sid="ms-app://s-1-15-2-42"
    )
    answer = browser.post(url, data)
    assert answer.status_code == 302, answer.context["adminform"].form.errors
    # The app's row and its credentials records: each change named, by whom, from where.
    entries = list(
        AuditEntry.objects.filter(object_type="relay.app", action="changed", user_id=operator.pk)
    )
    wns = [entry for entry in entries if entry.detail == "wns credentials"]
    assert len(wns) == 1 and set(wns[0].fields) == {"wns_secret", "wns_package_sid"}
    for entry in entries:
        assert (entry.actor, entry.user_id, entry.address) == (
            "operator",
            operator.pk,
            "203.0.113.9",
        )
        assert entry.tenant_id == world.tenant.pk
    every_entry = "".join(
        str(row) for row in AuditEntry.objects.values_list("fields", "detail", "object_repr")
    )
    assert secret not in every_entry and "s-1-15-2-42" not in every_entry

    # A deletion is recorded with the tenant's id, even the tenant's own (the entries outlive
    # what they name).
    delete = browser.post(
        reverse("admin:relay_component_delete", args=[world.component.pk]), {"post": "yes"}
    )
    assert delete.status_code == 302
    tenant_pk = world.tenant.pk
    world.tenant.delete()
    gone = set(AuditEntry.objects.filter(action="deleted").values_list("object_type", "tenant_id"))
    assert {
        ("relay.component", tenant_pk),
        ("relay.tenant", tenant_pk),
        ("relay.app", tenant_pk),
    } <= gone


@pytest.mark.django_db
def test_group_and_permission_changes_are_recorded():
    world = build_tenant("alpha")
    user = User.objects.create_user("newcomer", password=STRONG_PASSWORD, is_staff=True)
    user.groups.add(world.group)
    other = Group.objects.create(name="auditors")
    other.permissions.set([])
    entry = AuditEntry.objects.get(object_type="auth.user", detail="groups added")
    assert entry.object_repr == "newcomer" and entry.fields == ["groups"]
    assert entry.tenant_id == world.tenant.pk  # now one of alpha's staff
    assert AuditEntry.objects.filter(object_type="auth.group", object_repr="auditors").exists()
    # Without a request or command line of its own, the process names itself.
    assert " (" in entry.actor and "@" in entry.actor


@pytest.mark.django_db(transaction=True)
def test_load_tenants_and_rotate_credentials_are_recorded_as_commands(tmp_path: Path):
    document = tmp_path / "tenants.yaml"
    document.write_text(
        "tenants:\n"
        "  - name: provisioned\n"
        "    apps:\n"
        "      - name: uwpx\n"
        "        wns:\n"
        "          package_sid: ms-app://s-1-15-2-1\n"
        "          secret: provisioned-wns-secret\n"
    )
    old_key, new_key = Fernet.generate_key().decode(), Fernet.generate_key().decode()

    def manage(*args: str, keys: str) -> None:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=service_env(CREDENTIAL_KEYS=keys),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr

    manage("load_tenants", str(document), keys=old_key)
    app = App.objects.get(name="uwpx")
    created = AuditEntry.objects.get(object_type="relay.app", action="created")
    assert created.actor.startswith("manage.py load_tenants (") and created.user_id is None
    assert created.tenant_id == app.tenant_id
    # The credentials are a record of their own, named on the app as the admin's form names them.
    given = AuditEntry.objects.get(object_type="relay.app", action="changed")
    assert given.actor == created.actor and given.detail == "wns credentials"
    assert "wns_secret" in given.fields and "wns_package_sid" in given.fields
    assert AuditEntry.objects.filter(object_type="relay.tenant", action="created").exists()

    manage("rotate_credentials", keys=f"{new_key},{old_key}")
    rotated = AuditEntry.objects.exclude(pk=given.pk).get(object_type="relay.app", action="changed")
    assert rotated.actor.startswith("manage.py rotate_credentials (")
    assert "wns_secret" in rotated.fields and rotated.detail == "re-encrypted with the current key"
    text = str(list(AuditEntry.objects.values()))
    assert "provisioned-wns-secret" not in text


@pytest.mark.django_db
def test_operators_export_the_trail_as_csv_and_tenant_staff_only_theirs():
    alpha, bravo = build_tenant("alpha"), build_tenant("bravo")
    operator_browser = verified_client(make_operator())
    every = list(AuditEntry.objects.values_list("pk", flat=True))
    answer = operator_browser.post(
        "/admin/operators/auditentry/", {"action": "export_csv", "_selected_action": every}
    )
    assert answer.status_code == 200
    rows = list(csv.reader(io.StringIO(b"".join(answer.streaming_content).decode())))
    assert rows[0][:5] == ["at", "actor", "user_id", "address", "action"]
    assert {row[10] for row in rows[1:]} >= {str(alpha.tenant.pk), str(bravo.tenant.pk)}

    staff = make_tenant_staff(alpha, "alpha-admin", every_permission=False)
    staff_browser = verified_client(staff)
    answer = staff_browser.post(
        "/admin/operators/auditentry/", {"action": "export_csv", "_selected_action": every}
    )
    rows = list(csv.reader(io.StringIO(b"".join(answer.streaming_content).decode())))
    assert len(rows) > 1
    assert {row[10] for row in rows[1:]} == {str(alpha.tenant.pk)}


@pytest.mark.django_db
def test_the_trail_is_pruned_with_the_other_records():
    Tenant.objects.create(name="kept")
    old = AuditEntry.objects.create(
        at=timezone.now() - timedelta(days=40), actor="x", action="created"
    )
    pruned = retention.prune(days=30)
    assert pruned["operators_auditentry"] == 1
    assert not AuditEntry.objects.filter(pk=old.pk).exists()
    assert AuditEntry.objects.filter(object_repr="kept").exists()


@pytest.mark.django_db
def test_a_failed_login_is_recorded_without_the_password():
    make_operator()
    answer = Client(REMOTE_ADDR="198.51.100.77").post(
        reverse("admin:login"), {"username": "operator", "password": "guess-123456"}
    )
    assert answer.status_code == 200
    entry = AuditEntry.objects.get(action="login_failed")
    assert (entry.actor, entry.address, entry.user_id) == ("operator", "198.51.100.77", None)
    assert entry.object_repr == "operator" and entry.detail == "wrong password"
    assert "guess-123456" not in str(list(AuditEntry.objects.values()))


@pytest.mark.django_db(transaction=True)
def test_deleting_a_staff_member_with_devices_is_recorded():
    """Committed for real: the database checks its constraints at the commit."""
    alpha = build_tenant("alpha")
    staff = make_tenant_staff(alpha, "alpha-admin", every_permission=False)
    verified_client(staff)  # gives them a device
    operator_browser = verified_client(make_operator())
    answer = operator_browser.post(
        reverse("admin:auth_user_delete", args=[staff.pk]), {"post": "yes"}
    )
    assert answer.status_code == 302
    assert not User.objects.filter(username="alpha-admin").exists()
    deleted = set(
        AuditEntry.objects.filter(action="deleted", actor="operator").values_list(
            "object_type", "object_repr"
        )
    )
    assert ("auth.user", "alpha-admin") in deleted
    assert any(kind == "otp_static.staticdevice" for kind, _ in deleted)
