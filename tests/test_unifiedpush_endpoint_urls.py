"""A component's UnifiedPush endpoint URL is ASCII: checked when saved, safe when old.

Testers saved `http://пример.example` in the admin; every POST to its endpoints then failed
after the message was handled (a non-ASCII `Location`), and a kept-alive connection hung.
Now the host is stored in IDNA, what cannot be is refused with a clear error, and rows saved
before are served with an ASCII Location (the real web process: test_web_server.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse

from relay.models import Component, Tenant
from relay.services.provisioning import load_tenants
from relay.unifiedpush import endpoint_urls
from relay.unifiedpush import http as unifiedpush_http
from relay.unifiedpush.models import ComponentSettings, UnifiedPushMessage
from relay.unifiedpush.services import messages
from tests.support.admin import (
    admin_settings,  # noqa: F401 -- fixture
    build_tenant,
    changeform_data,
    login_verified,
    make_operator,
    make_tenant_staff,
)
from tests.support.endpoints import new_endpoint
from tests.support.unifiedpush_components import serving_unifiedpush, set_endpoint_url

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]

# The UnifiedPush inline's fields on the component's page.
URL, DAYS = "unifiedpush_settings-0-endpoint_url", "unifiedpush_settings-0-token_lifetime_days"

IDN = "http://пример.example"
IDNA = "http://xn--e1afmkfd.example"
# A label Django's URL validator accepts (60 characters) but IDNA cannot hold (over 63 bytes).
TOO_LONG_LABEL = "https://" + "é" * 60 + ".example"


@pytest.fixture(autouse=True)
def fresh_limits():
    messages.reset_limits()
    yield
    messages.reset_limits()


def _add_component(client: Client, url: str):
    tenant = Tenant.objects.create(name="acme")
    add = reverse("admin:relay_component_add") + f"?tenant={tenant.pk}"
    page = client.get(add)
    return client.post(add, changeform_data(page, jid="up.acme.example", **{URL: url}))


@pytest.mark.usefixtures("admin_settings")
@pytest.mark.parametrize(
    "typed, stored",
    [
        (IDN, IDNA),
        ("https://Bücher.example:8443/relay/é", "https://xn--bcher-kva.example:8443/relay/%C3%A9"),
        ("https://push.example.org", "https://push.example.org"),
    ],
)
def test_the_admin_stores_the_ascii_form(typed, stored):
    client = Client()
    login_verified(client, make_operator())
    response = _add_component(client, typed)
    assert response.status_code == 302, response.context["adminform"].form.errors
    assert ComponentSettings.objects.get(component__jid="up.acme.example").endpoint_url == stored


@pytest.mark.usefixtures("admin_settings")
@pytest.mark.parametrize(
    "url, error",
    [
        (TOO_LONG_LABEL, "cannot be written in ASCII (IDNA)"),
        ("ftp://push.example.org", "Use an http:// or https:// URL."),
        ("https://push.example/" + "é" * 40, "At most 200 characters once in ASCII"),
    ],
)
def test_the_admin_refuses_what_cannot_be_ascii_with_a_clear_error(url, error):
    client = Client()
    login_verified(client, make_operator())
    response = _add_component(client, url)
    assert response.status_code == 200
    (inline,) = response.context["inline_admin_formsets"]
    assert error in str(inline.formset.forms[0].errors["endpoint_url"])
    assert not Component.objects.exists()


def test_full_clean_normalises_and_refuses():
    tenant = Tenant.objects.create(name="clean")
    component = Component.objects.create(tenant=tenant, jid="up.clean.example", secret="x")
    settings = ComponentSettings(component=component, endpoint_url=IDN + "/relay/")
    settings.full_clean()
    assert settings.endpoint_url == IDNA + "/relay/"
    settings.endpoint_url = TOO_LONG_LABEL
    with pytest.raises(ValidationError) as raised:
        settings.full_clean()
    assert "cannot be written in ASCII" in str(raised.value.message_dict)
    assert list(raised.value.message_dict) == ["endpoint_url"]


@pytest.mark.usefixtures("admin_settings")
def test_tenant_staff_can_save_a_component_whose_old_url_is_invalid():
    """The URL is the operator's (read-only for tenant staff): a row saved before the check
    neither blocks their change nor crashes the form."""
    world = build_tenant("staffed")
    ComponentSettings.objects.create(component=world.component, endpoint_url="not a url")
    client = Client()
    login_verified(client, make_tenant_staff(world, "staffer", every_permission=True))
    url = reverse("admin:relay_component_change", args=[world.component.pk])
    response = client.post(url, changeform_data(client.get(url), **{DAYS: 3}))
    assert response.status_code == 302
    settings = ComponentSettings.objects.get(component=world.component)
    assert settings.token_lifetime_days == 3
    assert settings.endpoint_url == "not a url"


def test_load_tenants_stores_the_ascii_form(tmp_path: Path):
    document = f"""
tenants:
  - name: example
    components:
      - jid: up.example.org
        secret: component-secret-0123456789
        unifiedpush:
          endpoint_url: {IDN}
"""
    load_tenants(document, base_dir=tmp_path)
    assert ComponentSettings.objects.get(component__jid="up.example.org").endpoint_url == IDNA


@pytest.mark.parametrize(
    "old, base",
    [
        (IDN, IDNA),
        (TOO_LONG_LABEL, "https://" + "%C3%A9" * 60 + ".example"),
        ("https://push.example/a b", "https://push.example/a%20b"),
    ],
)
def test_rows_saved_before_the_check_get_ascii_endpoints_and_locations(push_client, old, base):
    tenant = Tenant.objects.create(name="old")
    component = serving_unifiedpush(
        tenant=tenant, jid="up.old.example", secret="x", endpoint_url=IDNA
    )
    set_endpoint_url(component, old)
    endpoint = new_endpoint(component)
    assert endpoint.startswith(base + "/push/v4.local.")
    token = endpoint.rsplit("/", 1)[1]
    # The resource (through the real web server: test_web_server.py).
    response = push_client.post(
        f"/push/{token}", data=b"hi", content_type="application/octet-stream"
    )
    assert response.status_code == 201
    assert response["Location"].startswith(base + "/push/message/")
    assert UnifiedPushMessage.objects.count() == 1


def test_an_answer_whose_header_cannot_be_sent_becomes_a_500():
    """Every answer of the resource passes through `sendable`: whatever was computed, the
    client gets an answer it can read."""
    good = (201, [("Location", IDNA + "/push/message/x"), ("TTL", "60")], b"")
    assert unifiedpush_http.sendable(good) == good
    for headers in (
        [("Location", IDN + "/push/message/x")],
        [("Location", "https://a.example/\r\nSet-Cookie: x=1")],
        [("Bad Name", "x")],
    ):
        assert unifiedpush_http.sendable((201, headers, b"")) == unifiedpush_http.CRASHED


def test_ascii_form_never_fails():
    for url in (IDN, TOO_LONG_LABEL, "not a url", "http://[::1", "https://x.example/é?q#f"):
        assert endpoint_urls.ascii_form(url).isascii()
