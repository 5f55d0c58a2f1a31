"""The admin's login lockout (django-axes), where a login lands, and the Content-Security-Policy.

The lockout tests use the configured default cache and database, as production does: the
lockout used to outlive `LOGIN_LOCKOUT_SECONDS` (the cache re-saved its counter with its own
one-hour timeout), and fifty failures from one proxy address locked every admin out.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.db.models import F
from django.test import Client
from django.urls import reverse

from tests.support.admin import (
    STRONG_PASSWORD,
    admin_settings,  # noqa: F401 -- fixture
    build_tenant,
    login_verified,
    make_operator,
)

pytestmark = [
    pytest.mark.defaults,
    pytest.mark.django_db(transaction=False),
    pytest.mark.usefixtures("admin_settings"),
]

LOCKED = "Too many failed login attempts"


@pytest.fixture
def operator(db):
    return make_operator()


def attempt(
    browser: Client,
    username: str,
    password: str,
    address: str = "192.0.2.1",
    forwarded: str | None = None,
):
    extra = {"REMOTE_ADDR": address}
    if forwarded is not None:
        extra["HTTP_X_FORWARDED_FOR"] = forwarded
    return browser.post(
        reverse("admin:login"), {"username": username, "password": password}, **extra
    )


def assert_locked(response) -> None:
    assert response.status_code == 429, response.status_code
    assert LOCKED in response.content.decode()


def assert_logged_in(response, browser: Client) -> None:
    assert response.status_code == 302, response.content.decode()[:500]
    assert "_auth_user_id" in browser.session
    browser.logout()


def age_login_failures(seconds: float) -> None:
    """Move every recorded failure `seconds` into the past: the lockout counts from the
    failure's time in axes' table (its public model), so the test needs no wall-clock wait."""
    AccessAttempt.objects.update(attempt_time=F("attempt_time") - timedelta(seconds=seconds))


def test_lockout_lasts_the_configured_time_and_no_longer(operator, settings):
    settings.RELAY = {**settings.RELAY, "LOGIN_MAX_FAILURES": 3, "LOGIN_LOCKOUT_SECONDS": 60}
    browser = Client()
    for _ in range(2):
        assert "Please enter the correct" in attempt(browser, "operator", "wrong").content.decode()
    assert_locked(attempt(browser, "operator", "wrong"))  # the third failure locks
    locked = attempt(browser, "operator", STRONG_PASSWORD)
    assert_locked(locked)
    assert locked["Retry-After"] == "60"  # whole minutes, rounded up
    assert "_auth_user_id" not in browser.session
    # 50 of the 60 seconds gone (10 s of margin for a slow machine): still locked, and trying
    # during the lockout does not make it longer...
    age_login_failures(50)
    assert_locked(attempt(browser, "operator", "wrong"))
    assert_locked(attempt(browser, "operator", STRONG_PASSWORD))
    # ...so 61 s after the failure that locked, it is over (a lockout restarted by the attempt
    # above would still have 49 s to go).
    age_login_failures(11)
    assert_logged_in(attempt(browser, "operator", STRONG_PASSWORD), browser)


def test_one_address_never_locks_everyone_out(operator):
    """Sixty failures for a dozen usernames from one (proxy) address: each of those usernames
    is locked from there, the operator's own login from the same address still works."""
    browser = Client()
    for index in range(12):
        for _ in range(5):
            attempt(browser, f"guess{index}", "wrong", address="10.0.0.1")
    assert_locked(attempt(browser, "guess0", "wrong", address="10.0.0.1"))
    assert_logged_in(attempt(browser, "operator", STRONG_PASSWORD, address="10.0.0.1"), browser)


def test_guessing_a_username_elsewhere_does_not_lock_its_owner_out(operator):
    browser = Client()
    for _ in range(5):
        attempt(browser, "operator", "wrong", address="203.0.113.66")
    assert_locked(attempt(browser, "operator", STRONG_PASSWORD, address="203.0.113.66"))
    assert_logged_in(attempt(browser, "operator", STRONG_PASSWORD, address="192.0.2.1"), browser)
    # A success clears that address's own count: four more failures do not lock it.
    for _ in range(4):
        attempt(browser, "operator", "wrong", address="192.0.2.1")
    assert_logged_in(attempt(browser, "operator", STRONG_PASSWORD, address="192.0.2.1"), browser)


def test_behind_a_trusted_proxy_the_forwarded_address_counts(operator, settings):
    settings.RELAY = {**settings.RELAY, "TRUST_X_FORWARDED_FOR": True}
    browser = Client()
    for _ in range(5):
        attempt(browser, "operator", "wrong", address="10.0.0.1", forwarded="198.51.100.1")
    assert_locked(
        attempt(browser, "operator", STRONG_PASSWORD, address="10.0.0.1", forwarded="198.51.100.1")
    )
    # A forged entry left of the proxy's own does not get around the lockout...
    assert_locked(
        attempt(
            browser,
            "operator",
            STRONG_PASSWORD,
            address="10.0.0.1",
            forwarded="192.0.2.77, 198.51.100.1",
        )
    )
    # ...and another client behind the same proxy logs in.
    assert_logged_in(
        attempt(browser, "operator", STRONG_PASSWORD, address="10.0.0.1", forwarded="198.51.100.2"),
        browser,
    )


def test_without_proxy_trust_the_header_is_ignored(operator):
    browser = Client()
    for index in range(5):
        attempt(browser, "operator", "wrong", address="192.0.2.5", forwarded=f"198.51.100.{index}")
    assert_locked(
        attempt(browser, "operator", STRONG_PASSWORD, address="192.0.2.5", forwarded="192.0.2.200")
    )


def test_a_refused_next_lands_on_the_admin_index(operator):
    browser = Client()
    response = browser.post(
        reverse("admin:login") + "?next=https://evil.example/steal",
        {"username": "operator", "password": STRONG_PASSWORD, "next": "https://evil.example/"},
    )
    assert response.status_code == 302
    assert response.url == reverse("admin:index")
    # The operator has no second factor yet: the index sends them to enrol one first.
    index = browser.get(response.url)
    assert index.status_code == 302
    assert index["Location"].startswith(reverse("operators:enrol"))


INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*application/json)[^>]*>", re.I)
EVENT_HANDLER = re.compile(r"<[^>]+\son[a-z]+\s*=", re.I)


def test_pages_carry_a_strict_content_security_policy(operator):
    """A strict policy, and nothing on our pages that it would block (the browser test shows
    the same in Chromium: no violation reported)."""
    world = build_tenant("csp")
    browser = Client()
    login_verified(browser, operator)
    pages = [
        reverse("admin:index"),
        reverse("admin:health"),
        reverse("admin:usage"),
        reverse("admin:relay_tenant_change", args=[world.tenant.pk]),
        reverse("admin:relay_app_change", args=[world.app.pk]),
        reverse("admin:relay_component_change", args=[world.component.pk]),
        reverse("admin:relay_registration_change", args=[world.registration.pk]),
        reverse("admin:relay_delivery_changelist"),
        reverse("admin:relay_component_add"),
        "/api/v1/docs",
    ]
    for page in [*pages, reverse("admin:login")]:
        client = browser if page != reverse("admin:login") else Client()
        response = client.get(page)
        assert response.status_code == 200, page
        policy = dict(
            directive.strip().split(" ", 1)
            for directive in response["Content-Security-Policy"].split(";")
        )
        assert policy["default-src"] == "'self'"
        assert policy["script-src"] == "'self'", page
        assert policy["style-src"] == "'self'", page
        assert policy["object-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
        text = response.content.decode()
        assert not INLINE_SCRIPT.search(text), f"{page}: an inline script"
        assert "<style" not in text, f"{page}: an inline style element"
        assert not EVENT_HANDLER.search(text), f"{page}: an inline event handler"
    assert Client().get("/healthz")["Content-Security-Policy"]


def test_the_retired_per_address_setting_is_reported(settings):
    from relay.checks import login_settings_check

    assert login_settings_check() == []
    settings.RELAY = {**settings.RELAY, "LOGIN_MAX_FAILURES_PER_ADDRESS": "50"}
    assert [message.id for message in login_settings_check()] == ["relay.W020"]
