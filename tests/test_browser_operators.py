"""The admin's second step in a real browser (Debian's headless Chromium through Playwright).

An operator logs in with a password and is taken to enrol: they add an authenticator app
(TOTP codes computed by the test from the secret the page shows, RFC 6238 on the real clock),
keep their recovery codes, then add a passkey held by Chromium's virtual authenticator (CDP
WebAuthn domain: ctap2, internal transport, resident keys, user verification). Later logins
pass the second step with the passkey, with a recovery code and with a TOTP code; without
it no admin page opens. Each step's audit entries are checked. Screenshots land in
test-artifacts/operators/.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from relay.operators.models import AuditEntry, WebAuthnKey
from tests.support.admin import (
    STRONG_PASSWORD,
    admin_settings,  # noqa: F401 -- fixture
)
from tests.support.browser import chromium_page
from tests.support.otp import totp

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("admin_settings")]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "operators"


@pytest.fixture
def browser(live_server, monkeypatch) -> Iterator[tuple[Page, Any]]:
    """A page of a fresh headless Chromium with a virtual authenticator, and its CDP session.

    No page may trip the Content-Security-Policy (our WebAuthn script is a static file)."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with chromium_page(width=1280) as (page, context):
        cdp = context.new_cdp_session(page)
        cdp.send("WebAuthn.enable")
        added = cdp.send(
            "WebAuthn.addVirtualAuthenticator",
            {
                "options": {
                    "protocol": "ctap2",
                    "transport": "internal",
                    "hasResidentKey": True,
                    "hasUserVerification": True,
                    "isUserVerified": True,
                }
            },
        )
        yield page, (cdp, added["authenticatorId"])


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def log_in(page: Page, base: str, next_path: str = "/admin/") -> None:
    page.goto(base + next_path)
    expect(page.locator("#id_username")).to_be_visible()
    page.fill("#id_username", "operator")
    page.fill("#id_password", STRONG_PASSWORD)
    page.click("input[type=submit]")


def log_out(page: Page) -> None:
    page.click("#logout-form button")
    expect(page.locator("#content")).to_contain_text("Logged out")


def details(action: str) -> list[str]:
    return list(
        AuditEntry.objects.filter(actor="operator", action=action)
        .order_by("id")
        .values_list("detail", flat=True)
    )


def test_operator_enrols_totp_and_a_passkey_and_passes_the_second_step_each_way(
    live_server, browser, settings
):
    # django-otp's backoff per device (a second after a wrong code) off: the wrong code below
    # is followed at once by a right one (tests/test_operators_second_factor.py shows it on).
    settings.OTP_TOTP_THROTTLE_FACTOR = 0
    settings.OTP_STATIC_THROTTLE_FACTOR = 0
    page, (cdp, authenticator) = browser
    base = live_server.url
    User.objects.create_superuser("operator", password=STRONG_PASSWORD)

    # The password alone leads to enrolment, nowhere else.
    log_in(page, base)
    expect(page.locator("#totp-secret")).to_be_visible()
    assert "/admin/second-factor/enrol/" in page.url
    shot(page, "01-enrol")
    secret = page.locator("#totp-secret").inner_text().strip()
    page.fill("#id_code", totp(secret))
    page.click("#enrol-form input[type=submit]")
    expect(page.locator("#recovery-codes code")).to_have_count(10)
    codes = [code.strip() for code in page.locator("#recovery-codes code").all_inner_texts()]
    assert len(codes) == 10 and all(re.fullmatch(r"[a-z0-9]{5}-[a-z0-9]{5}", c) for c in codes)
    shot(page, "02-recovery-codes")
    page.click("#recovery-done")
    expect(page.get_by_role("link", name="Onboard a tenant")).to_be_visible()
    assert details("second_step") == ["TOTP enrolment"]

    # A passkey, made by Chromium's virtual authenticator.
    page.goto(base + "/admin/security/")
    page.fill("#id_key_name", "virtual passkey")
    page.click("#add-passkey")
    expect(page.locator("#passkeys")).to_contain_text("virtual passkey")
    shot(page, "03-security-page")
    key = WebAuthnKey.objects.get()
    assert key.name == "virtual passkey" and key.user.username == "operator"
    stored = cdp.send("WebAuthn.getCredentials", {"authenticatorId": authenticator})["credentials"]
    assert len(stored) == 1 and stored[0]["isResidentCredential"]
    assert AuditEntry.objects.filter(
        action="created", object_type="operators.webauthnkey", actor="operator"
    ).exists()
    log_out(page)

    # Without the second step nothing opens; the passkey passes it.
    log_in(page, base, "/admin/relay/tenant/")
    expect(page.locator("#use-passkey")).to_be_visible()
    for path in ("/admin/", "/admin/relay/app/", "/admin/security/", "/admin/auth/user/"):
        page.goto(base + path)
        assert "/admin/second-factor/" in page.url, path
    shot(page, "04-second-step")
    page.click("#use-passkey")
    # Back to the page asked for last.
    expect(page.locator("#result_list")).to_contain_text("operator")
    assert page.url.endswith("/admin/auth/user/")
    key.refresh_from_db()
    assert key.last_used_at is not None
    assert details("second_step")[-1] == "security key"
    log_out(page)

    # A recovery code, once.
    log_in(page, base)
    page.fill("#id_code", codes[0])
    page.click("#code-form input[type=submit]")
    expect(page.get_by_role("link", name="Onboard a tenant")).to_be_visible()
    assert details("second_step")[-1] == "recovery code"
    log_out(page)

    # A wrong code is refused and recorded; the used recovery code too; then a TOTP code.
    log_in(page, base)
    page.fill("#id_code", codes[0])
    page.click("#code-form input[type=submit]")
    expect(page.locator("#second-step-error")).to_be_visible()
    shot(page, "05-refused")
    assert details("second_step_failed") == ["wrong code"]
    page.goto(base + "/admin/relay/tenant/")
    assert "/admin/second-factor/" in page.url
    # The enrolment used this step's code: the next step's, as the app shows it soon after.
    page.fill("#id_code", totp(secret, steps_ahead=1))
    page.click("#code-form input[type=submit]")
    expect(page.locator("#changelist")).to_be_visible()
    assert page.url.endswith("/admin/relay/tenant/")
    assert details("second_step")[-1] == "TOTP"
    shot(page, "06-after-totp")

    actions = set(AuditEntry.objects.filter(actor="operator").values_list("action", flat=True))
    assert {"logged_in", "logged_out", "second_step", "second_step_failed", "created"} <= actions
    assert all(
        entry.address == "127.0.0.1"
        for entry in AuditEntry.objects.filter(actor="operator", action="logged_in")
    )
