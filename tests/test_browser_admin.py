"""An operator onboards a tenant in a real browser (Debian's headless Chromium).

Log in, add a tenant, its app (FCM credentials of a fake FCM) and its component, paste the
generated configuration into a real Prosody, watch the link come up, let a phone register over
XMPP, send it a test push from the admin, and find the push in the delivery log. The admin
is served by Django's live server on the test database; the gateway and the worker are our
real processes. Every request the browser makes must stay on the admin's own host (the admin
works offline), and the screenshots land in test-artifacts/admin/.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from relay.models import ComponentLink, Delivery, Registration
from tests.fakes.fcm import FakeFcm
from tests.support.admin import admin_settings  # noqa: F401 -- fixture
from tests.support.browser import chromium_page
from tests.support.otp import totp
from tests.support.ports import free_port
from tests.support.processes import start_gateway, start_worker
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("admin_settings")]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "admin"
PASSWORD = "correct horse battery staple 42"
COMPONENT_JID = "push.localhost"


@pytest.fixture
def fake_fcm() -> Iterator[FakeFcm]:
    with FakeFcm() as fake:
        yield fake


@pytest.fixture
def services() -> Iterator[None]:
    gateway, worker = start_gateway(), start_worker()
    wait_until(lambda: "gateway.started" in gateway.log_text(), timeout=30)
    wait_until(lambda: " ready." in worker.log_text(), timeout=60)
    yield
    codes = gateway.stop(), worker.stop()
    assert codes == (0, 0), gateway.log_text()[-2000:] + worker.log_text()[-2000:]


@pytest.fixture
def browser_page(live_server, monkeypatch) -> Iterator[tuple[Page, list[str]]]:
    """A page of a fresh headless Chromium, and the URLs of every request it makes.

    No page may trip the Content-Security-Policy: the fixture fails the test if one did."""
    # Playwright's sync API keeps an event loop in this thread; the test's own ORM calls are
    # still plain synchronous code (the live server answers from its own thread).
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    requests: list[str] = []
    with chromium_page(width=1440) as (page, _):
        page.on("request", lambda request: requests.append(request.url))
        yield page, requests


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def enrol_authenticator(page: Page) -> None:
    """After the password, a first login is taken to set up a second factor: an authenticator
    app, whose codes the test computes from the key the page shows (tests/support/otp.py)."""
    expect(page.locator("#totp-secret")).to_be_visible()
    page.fill("#id_code", totp(page.locator("#totp-secret").inner_text().strip()))
    page.click("#enrol-form input[type=submit]")
    expect(page.locator("#recovery-codes code")).to_have_count(10)
    page.click("#recovery-done")


def test_operator_onboards_a_tenant_and_sends_a_test_push(
    live_server, browser_page, services, fake_fcm, xmpp_server_factory, xmpp_client_factory
):
    page, requests = browser_page
    User.objects.create_superuser("operator", password=PASSWORD)
    component_port = free_port()

    # Log in.
    page.goto(live_server.url + "/admin/")
    expect(page.locator("#id_username")).to_be_visible()
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    shot(page, "01-login")
    page.click("input[type=submit]")
    enrol_authenticator(page)
    expect(page.get_by_role("link", name="Onboard a tenant")).to_be_visible()
    shot(page, "02-home")

    # The tenant.
    page.get_by_role("link", name="Onboard a tenant").click()
    page.fill("#id_name", "acme")
    page.fill("#id_display_name", "Acme Hosting")
    page.fill("#id_allowed_domains", "localhost")
    shot(page, "03-add-tenant")
    page.click("input[name=_save]")
    expect(page.locator(".relay-steps")).to_contain_text("Apps with provider credentials")

    # Its app, with FCM credentials (the fake's); the screenshot is taken before the paste.
    page.get_by_role("link", name="Add an app").click()
    page.fill("#id_name", "conversations")
    page.fill("#id_fcm_endpoint", fake_fcm.url)
    shot(page, "04-add-app")
    page.fill("#id_fcm_service_account", json.dumps(fake_fcm.service_account()))
    page.click("input[name=_save]")
    expect(page.locator(".messagelist")).to_contain_text("Added the app conversations")

    # Its component: the secret is left empty, so a strong one is generated.
    page.get_by_role("link", name="Add a component").click()
    page.fill("#id_jid", COMPONENT_JID)
    page.fill("#id_host", "127.0.0.1")
    page.fill("#id_port", str(component_port))
    shot(page, "05-add-component")
    page.click("input[name=_save]")
    snippet = page.locator("#prosody-snippet")
    expect(snippet).to_contain_text(f'Component "{COMPONENT_JID}"')
    secret = re.search(r'component_secret = "([^"]+)"', snippet.inner_text()).group(1)
    assert len(secret) >= 43
    # The relay's stylesheet (no inline <style> under the CSP) is applied.
    expect(snippet).to_have_css("white-space", "pre")
    shot(page, "06-component-configuration")

    # The XMPP server's admin pastes it; the running gateway connects within seconds.
    prosody = xmpp_server_factory(
        "prosody", [(COMPONENT_JID, secret)], component_port=component_port
    )
    wait_until(
        lambda: ComponentLink.objects.filter(component__jid=COMPONENT_JID, state="up").exists(),
        timeout=30,
    )
    page.reload()
    expect(page.locator(".relay-link-status .relay-link-up")).to_be_visible()
    shot(page, "07-link-up")

    # A phone registers through its server, as Conversations does.
    phone = xmpp_client_factory(prosody, "phone")
    reply = phone.execute_command(
        COMPONENT_JID, "register-push-fcm", {"token": "fcm-token-1", "device-id": "device-1"}
    )
    assert reply.get("type") == "result", reply
    registration = Registration.objects.get()

    # Find it by its account's domain, and send it a test push.
    page.goto(live_server.url + "/admin/relay/registration/")
    page.fill("#searchbar", "localhost")
    page.press("#searchbar", "Enter")
    page.get_by_role("link", name=registration.node).click()
    page.click("#send-test-push")
    expect(page.locator(".messagelist")).to_contain_text("Test push queued")
    shot(page, "08-registration-test-push")
    [sent] = fake_fcm.wait_for_requests(1, timeout=30)
    assert sent.token == "fcm-token-1"
    wait_until(lambda: Delivery.objects.filter(outcome="delivered").exists(), timeout=30)

    # The delivery log shows it.
    page.get_by_role("link", name="delivery log").click()
    expect(page.locator("#result_list")).to_contain_text("delivered")
    expect(page.locator("#result_list")).to_contain_text("acme/conversations")
    shot(page, "09-delivery-log")

    # Health and usage at a glance.
    page.goto(live_server.url + "/admin/health/")
    expect(page.locator("#links-up")).to_contain_text("1 / 1")
    shot(page, "10-health")
    page.goto(live_server.url + "/admin/relay/tenant/")
    page.get_by_role("link", name="acme").click()
    expect(page.locator("svg.relay-chart")).to_be_visible()
    shot(page, "11-tenant-page")

    # The API's interactive docs (Swagger UI, served by this site) work under the policy.
    page.goto(live_server.url + "/api/v1/docs")
    expect(page.locator(".swagger-ui .info .title")).to_be_visible()
    expect(page.locator(".opblock").first).to_be_visible()
    shot(page, "14-api-docs")

    own = urlsplit(live_server.url).netloc
    foreign = [url for url in requests if urlsplit(url).netloc not in (own, "")]
    assert not foreign, f"the admin fetched from other hosts: {foreign}"


def test_tenant_staff_see_their_tenant_only(live_server, browser_page):
    """The same admin for a tenant's own staff: their tenant's objects, no credential."""
    from tests.support.admin import build_tenant, make_tenant_staff

    page, requests = browser_page
    alpha, bravo = build_tenant("alpha"), build_tenant("bravo")
    make_tenant_staff(alpha, "alpha-admin", every_permission=False)
    page.goto(live_server.url + "/admin/login/")
    page.fill("#id_username", "alpha-admin")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    enrol_authenticator(page)
    expect(page.locator("#user-tools")).to_contain_text("alpha-admin")
    shot(page, "12-tenant-staff-home")
    page.goto(live_server.url + "/admin/relay/component/")
    expect(page.locator("#result_list")).to_contain_text(alpha.component.jid)
    shot(page, "13-tenant-staff-components")
    page.goto(live_server.url + f"/admin/relay/component/{alpha.component.pk}/change/")
    expect(page.locator("#prosody-snippet")).to_contain_text("<the component secret>")
    for url in ("/admin/", "/admin/relay/component/", "/admin/health/", "/admin/usage/"):
        page.goto(live_server.url + url)
        text = page.content()
        assert "bravo" not in text.lower() and alpha.component.secret not in text, url
    page.goto(live_server.url + f"/admin/relay/component/{bravo.component.pk}/change/")
    assert urlsplit(page.url).path == "/admin/"  # "does not exist", like any unknown id
    assert not [url for url in requests if urlsplit(url).netloc != urlsplit(live_server.url).netloc]
