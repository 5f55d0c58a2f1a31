"""The admin's second step (relay/operators): no admin page answers a staff member who must
pass it until they have; enrolling TOTP and recovery codes; failures counted by axes; the
tenants' policy; the commands that enrol and reset devices. Every step is in the audit trail.

TOTP codes come from tests/support/otp.py (RFC 6238 on the real clock, from the secret the
page or the command showed), as a phone would compute them.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from relay.operators.models import AuditEntry, TenantSecurityPolicy
from tests.support.admin import (
    STRONG_PASSWORD,
    admin_settings,  # noqa: F401 -- fixture
    build_tenant,
    make_operator,
    make_tenant_staff,
)
from tests.support.otp import totp
from tests.support.processes import ROOT, service_env

pytestmark = [pytest.mark.defaults, pytest.mark.usefixtures("admin_settings")]

ADDRESS = "192.0.2.7"
ADMIN_PAGES = (
    "/admin/",
    "/admin/relay/tenant/",
    "/admin/relay/app/",
    "/admin/auth/user/",
    "/admin/health/",
    "/admin/operators/auditentry/",
    "/admin/security/",
)


def password_login(username: str) -> Client:
    browser = Client(REMOTE_ADDR=ADDRESS)
    answer = browser.post(
        reverse("admin:login"), {"username": username, "password": STRONG_PASSWORD}
    )
    assert answer.status_code == 302, answer.content.decode()[:300]
    return browser


def enrol(browser: Client) -> tuple[str, list[str]]:
    """Enrol an authenticator app through the page; returns its secret and recovery codes."""
    page = browser.get(reverse("operators:enrol"))
    assert page.status_code == 200
    secret = re.search(r'id="totp-secret">([A-Z2-7]+)<', page.content.decode()).group(1)
    assert 'src="data:image/svg+xml' in page.content.decode()  # the QR code
    answer = browser.post(reverse("operators:enrol"), {"code": totp(secret), "name": "phone"})
    assert answer.status_code == 200, answer.content.decode()[:500]
    codes = re.findall(r"<li><code>([a-z0-9-]+)</code></li>", answer.content.decode())
    assert len(codes) == 10
    assert answer["Cache-Control"] == "no-store"
    return secret, codes


@pytest.fixture
def no_device_backoff(settings):
    """django-otp's own backoff per device (1 s after a failure, doubling) off, for tests that
    follow a wrong code by a right one at once; `test_a_device_backs_off_after_a_failure`
    shows it on."""
    settings.OTP_TOTP_THROTTLE_FACTOR = 0
    settings.OTP_STATIC_THROTTLE_FACTOR = 0


def actions_of(username: str) -> list[str]:
    return list(
        AuditEntry.objects.filter(actor=username).order_by("id").values_list("action", flat=True)
    )


@pytest.mark.django_db
@pytest.mark.usefixtures("no_device_backoff")
def test_nothing_of_the_admin_answers_before_the_second_step():
    make_operator()
    browser = password_login("operator")
    for url in ADMIN_PAGES:
        answer = browser.get(url)
        assert answer.status_code == 302, url
        assert answer["Location"].startswith(reverse("operators:enrol")), url
    # A POST that would change something is refused the same way.
    answer = browser.post("/admin/relay/tenant/add/", {"name": "sneaky"})
    assert answer.status_code == 302 and "sneaky" not in str(AuditEntry.objects.all())
    secret, _ = enrol(browser)
    for url in ADMIN_PAGES:
        assert browser.get(url).status_code == 200, url
    browser.logout()

    # The next login has a device: the second step, and nothing else, until it is passed.
    browser = password_login("operator")
    for url in ADMIN_PAGES:
        answer = browser.get(url)
        assert answer["Location"].startswith(reverse("operators:second_step")), url
    assert browser.get(reverse("operators:enrol"))["Location"] == reverse(
        "operators:second_step"
    )  # no second device without the first
    wrong = browser.post(reverse("operators:second_step"), {"code": "000000"})
    assert "That code is not right" in wrong.content.decode()
    passed = browser.post(
        reverse("operators:second_step"),
        {"code": totp(secret, steps_ahead=1), "next": "/admin/relay/tenant/"},
    )
    assert passed.status_code == 302 and passed["Location"] == "/admin/relay/tenant/"
    assert browser.get("/admin/relay/tenant/").status_code == 200

    assert actions_of("operator") == [
        "logged_in",
        "created",  # the TOTP device (and its owner's other sessions ended)
        "sessions_ended",
        "second_step",
        "created",  # the recovery codes
        "sessions_ended",
        "logged_out",
        "logged_in",
        "second_step_failed",
        "second_step",
    ]
    device_entry = AuditEntry.objects.get(object_type="otp_totp.totpdevice")
    assert device_entry.address == ADDRESS
    assert device_entry.user.username == "operator"
    assert "key" in device_entry.fields
    secret_hex = TOTPDevice.objects.get().key
    assert not AuditEntry.objects.filter(detail__contains=secret_hex).exists()


@pytest.mark.django_db
def test_a_recovery_code_works_once():
    make_operator()
    browser = password_login("operator")
    _, codes = enrol(browser)
    browser.logout()
    browser = password_login("operator")
    answer = browser.post(reverse("operators:second_step"), {"code": codes[3]})
    assert answer.status_code == 302
    assert browser.get("/admin/").status_code == 200
    browser.logout()
    browser = password_login("operator")
    again = browser.post(reverse("operators:second_step"), {"code": codes[3]})
    assert "That code is not right" in again.content.decode()
    assert browser.get("/admin/").status_code == 302
    assert StaticDevice.objects.get(name="recovery codes").token_set.count() == 9
    details = list(
        AuditEntry.objects.filter(action__startswith="second_step")
        .order_by("id")
        .values_list("detail", flat=True)
    )
    assert details == ["TOTP enrolment", "recovery code", "wrong code"]


@pytest.mark.django_db
@pytest.mark.usefixtures("no_device_backoff")
def test_failed_second_steps_lock_the_login_like_wrong_passwords(settings):
    settings.RELAY = {**settings.RELAY, "LOGIN_MAX_FAILURES": 3, "LOGIN_LOCKOUT_SECONDS": 600}
    make_operator()
    browser = password_login("operator")
    secret, _ = enrol(browser)
    browser.logout()

    browser = password_login("operator")
    for _ in range(2):
        answer = browser.post(reverse("operators:second_step"), {"code": "123456"})
        assert answer.status_code == 200
    # A fresh password login does not wipe the failed second steps.
    browser.logout()
    browser = password_login("operator")
    locked = browser.post(reverse("operators:second_step"), {"code": "654321"})
    assert locked.status_code == 429
    assert "Too many failed login attempts" in locked.content.decode()
    assert "_auth_user_id" not in browser.session  # logged out
    # The password alone is now refused too, and a right code no longer helps.
    again = Client(REMOTE_ADDR=ADDRESS).post(
        reverse("admin:login"), {"username": "operator", "password": STRONG_PASSWORD}
    )
    assert again.status_code == 429
    assert AuditEntry.objects.filter(action="second_step_failed").count() == 3
    # From another address the operator still gets in (axes counts username and address).
    elsewhere = Client(REMOTE_ADDR="198.51.100.9")
    elsewhere.post(reverse("admin:login"), {"username": "operator", "password": STRONG_PASSWORD})
    passed = elsewhere.post(reverse("operators:second_step"), {"code": totp(secret, steps_ahead=1)})
    assert passed.status_code == 302


@pytest.mark.django_db
def test_a_device_backs_off_after_a_failure():
    """Besides axes' lockout, each device refuses codes for a while after a wrong one, so
    guessing from many addresses gains nothing."""
    make_operator()
    browser = password_login("operator")
    secret, _ = enrol(browser)
    browser.logout()
    browser = password_login("operator")
    browser.post(reverse("operators:second_step"), {"code": "000000"})
    refused = browser.post(reverse("operators:second_step"), {"code": totp(secret, steps_ahead=1)})
    assert "That code is not right" in refused.content.decode()
    assert TOTPDevice.objects.get().throttling_failure_count >= 1


@pytest.mark.django_db
def test_tenant_staff_follow_their_tenants_policy():
    alpha = build_tenant("alpha")
    make_tenant_staff(alpha, "alpha-admin", every_permission=False)
    # Default: required.
    browser = password_login("alpha-admin")
    assert browser.get("/admin/")["Location"].startswith(reverse("operators:enrol"))
    browser.logout()
    # An operator relaxes it for alpha: a password is enough there.
    policy = TenantSecurityPolicy.objects.get(tenant=alpha.tenant)
    policy.second_factor_required = False
    policy.save()
    browser = password_login("alpha-admin")
    assert browser.get("/admin/").status_code == 200
    assert browser.get("/admin/relay/component/").status_code == 200
    # Tenant staff cannot change the policy, and see only their tenant's audit entries.
    assert browser.get("/admin/operators/tenantsecuritypolicy/").status_code == 403
    policy_entry = AuditEntry.objects.get(
        object_type="operators.tenantsecuritypolicy", action="changed"
    )
    assert policy_entry.tenant_id == alpha.tenant.pk
    assert policy_entry.fields == ["second_factor_required"]
    bravo = build_tenant("bravo")
    listing = browser.get("/admin/operators/auditentry/")
    assert listing.status_code == 200
    text = listing.content.decode()
    assert "alpha-admin" in text and "bravo" not in text.lower()
    assert AuditEntry.objects.filter(tenant=bravo.tenant).exists()
    # Required again: the staff member's next request is sent to enrol.
    TenantSecurityPolicy.objects.filter(tenant=alpha.tenant).update(second_factor_required=True)
    assert browser.get("/admin/")["Location"].startswith(reverse("operators:enrol"))


@pytest.mark.django_db(transaction=True)
def test_commands_enrol_and_reset_a_staff_members_devices():
    """Run as the real command lines: the audit names the command and the host's user."""
    User.objects.create_superuser("first", password=STRONG_PASSWORD)

    def manage(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=service_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    printed = manage("enrol_totp", "first", "--name", "laptop")
    secret = re.search(r"key \(type into the app\): ([A-Z2-7]+)", printed).group(1)
    codes = re.findall(r"^  ([a-z0-9-]{11})$", printed, flags=re.M)
    assert len(codes) == 10
    assert "otpauth://totp/" in printed
    browser = password_login("first")
    answer = browser.post(reverse("operators:second_step"), {"code": totp(secret)})
    assert answer.status_code == 302
    assert browser.get("/admin/").status_code == 200
    created = AuditEntry.objects.get(object_type="otp_totp.totpdevice", action="created")
    assert created.actor.startswith("manage.py enrol_totp (") and "@" in created.actor
    assert created.user is None

    manage("reset_devices", "first")
    assert not TOTPDevice.objects.exists() and not StaticDevice.objects.exists()
    # The reset ended the session that had passed the second step.
    assert browser.get("/admin/")["Location"].startswith(reverse("admin:login"))
    deleted = AuditEntry.objects.filter(
        action="deleted", actor__startswith="manage.py reset_devices"
    )
    assert {entry.object_type for entry in deleted} == {
        "otp_totp.totpdevice",
        "otp_static.staticdevice",
    }
    ended = AuditEntry.objects.filter(action="sessions_ended").order_by("id").last()
    assert ended.actor.startswith("manage.py reset_devices") and ended.object_repr == "first"
    # At the next login the staff member enrols anew.
    browser = password_login("first")
    assert browser.get("/admin/")["Location"].startswith(reverse("operators:enrol"))


@pytest.mark.django_db
def test_an_operator_resets_a_staff_members_second_factor_in_the_admin():
    operator = make_operator()
    alpha = build_tenant("alpha")
    staff = make_tenant_staff(alpha, "alpha-admin", every_permission=False)
    staff_browser = password_login("alpha-admin")
    enrol(staff_browser)
    assert staff_browser.get("/admin/").status_code == 200

    from tests.support.admin import login_verified

    operator_browser = Client(REMOTE_ADDR="203.0.113.5")
    login_verified(operator_browser, operator)
    answer = operator_browser.post(
        "/admin/auth/user/",
        {"action": "reset_second_factor", "_selected_action": [staff.pk]},
    )
    assert answer.status_code == 302
    assert not TOTPDevice.objects.filter(user=staff).exists()
    # The staff member's session is over; they log in and enrol anew.
    assert staff_browser.get("/admin/")["Location"].startswith(reverse("admin:login"))
    entries = AuditEntry.objects.filter(actor="operator", address="203.0.113.5")
    assert {(e.action, e.object_type) for e in entries} >= {
        ("deleted", "otp_totp.totpdevice"),
        ("deleted", "otp_static.staticdevice"),
        ("sessions_ended", "auth.user"),
    }
    assert all(e.tenant_id == alpha.tenant.pk for e in entries if e.object_repr != "operator")
