"""UnifiedPush in the admin: a component that serves it (with or without an app), its
snippet, and what a tenant's own staff may change."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from relay.models import Component, Tenant
from relay.unifiedpush.models import ComponentSettings, serves
from tests.support.admin import (
    admin_settings,  # noqa: F401 -- fixture
    build_tenant,
    changeform_data,
    login_verified,
    make_operator,
    make_tenant_staff,
)

# The UnifiedPush inline's fields on the component's page.
URL, DAYS = "unifiedpush_settings-0-endpoint_url", "unifiedpush_settings-0-token_lifetime_days"

pytestmark = [
    pytest.mark.defaults,
    pytest.mark.django_db,
    pytest.mark.usefixtures("admin_settings"),
]


@pytest.fixture
def operator_client(db) -> Client:
    client = Client()
    login_verified(client, make_operator())
    return client


def post_form(client: Client, url: str, **changes):
    page = client.get(url)
    assert page.status_code == 200, url
    return client.post(url, changeform_data(page, **changes))


def test_an_operator_adds_a_unifiedpush_only_component_and_gets_its_snippet(operator_client):
    tenant = Tenant.objects.create(name="acme")
    add = reverse("admin:relay_component_add") + f"?tenant={tenant.pk}"
    response = post_form(
        operator_client,
        add,
        jid="up.acme.example",
        host="xmpp.acme.example",
        **{URL: "https://push.acme.example", DAYS: "10"},
    )
    assert response.status_code == 302, response.context["adminform"].form.errors
    component = Component.objects.get(jid="up.acme.example")
    assert component.app is None and serves(component)
    assert component.unifiedpush_settings.token_lifetime_days == 10
    page = operator_client.get(response.url).content.decode()
    assert "https://push.acme.example/push/&lt;token&gt; (valid 10 days" in page
    assert "location /push/ { proxy_pass" in page
    assert "https://push.acme.example/_matrix/push/v1/notify" in page
    assert 'id="unifiedpush-snippet"' in page


@pytest.mark.parametrize(
    "url, error",
    [
        ("", "Choose an app (the p2 commands), set up UnifiedPush, or both."),
        ("https://push.acme.example/?x=1", "Give a base URL without user, query or fragment."),
        ("not a url", "Enter a valid URL."),
    ],
)
def test_a_component_must_serve_something_with_a_valid_url(operator_client, url, error):
    tenant = Tenant.objects.create(name="acme")
    add = reverse("admin:relay_component_add") + f"?tenant={tenant.pk}"
    response = post_form(operator_client, add, jid="up.acme.example", **{URL: url})
    assert response.status_code == 200
    assert error in response.content.decode()
    assert not Component.objects.exists()


def test_a_p2_component_shows_no_unifiedpush_snippet(operator_client):
    world = build_tenant("plain")
    page = operator_client.get(reverse("admin:relay_component_change", args=[world.component.pk]))
    assert 'id="unifiedpush-snippet"' not in page.content.decode()
    # Its inline is there, empty, saying how to turn UnifiedPush on.
    assert 'id="unifiedpush_settings-group"' in page.content.decode()
    assert "serve only the p2 commands" in page.content.decode()


def test_tenant_staff_change_the_lifetime_but_not_the_public_url(db):
    world = build_tenant("staffed")
    ComponentSettings.objects.create(
        component=world.component, endpoint_url="https://push.operator.example"
    )
    other = build_tenant("other")
    staff = make_tenant_staff(world, "staffer", every_permission=True)
    client = Client()
    login_verified(client, staff)
    url = reverse("admin:relay_component_change", args=[world.component.pk])
    response = post_form(
        client,
        url,
        **{DAYS: "3", URL: "https://evil.example"},
    )
    assert response.status_code == 302
    settings = ComponentSettings.objects.get(component=world.component)
    assert settings.token_lifetime_days == 3
    assert settings.endpoint_url == "https://push.operator.example"
    foreign = reverse("admin:relay_component_change", args=[other.component.pk])
    assert client.get(foreign).status_code in (302, 404)


def test_unifiedpush_deliveries_are_listed_per_tenant_read_only(operator_client):
    from django.utils import timezone

    from relay.unifiedpush.models import UnifiedPushDelivery

    mine, theirs = build_tenant("mine"), build_tenant("theirs")
    now = timezone.now()
    for world, size in ((mine, 111), (theirs, 222)):
        UnifiedPushDelivery.objects.create(
            tenant=world.tenant,
            component=world.component,
            outcome="delivered",
            urgency=2,
            received=now,
            finished=now,
            size=size,
            ttl=60,
            attempts=1,
        )
    staff = make_tenant_staff(mine, "mine-staff", every_permission=False)
    client = Client()
    login_verified(client, staff)
    url = reverse("admin:unifiedpush_unifiedpushdelivery_changelist")
    page = client.get(url)
    assert page.status_code == 200
    # build_tenant made one of each already (sizes 400 and 600).
    assert sorted(page.context["cl"].queryset.values_list("size", flat=True)) == [111, 400]
    assert operator_client.get(url).context["cl"].queryset.count() == 4
    record = UnifiedPushDelivery.objects.get(size=111)
    url = reverse("admin:unifiedpush_unifiedpushdelivery_change", args=[record.pk])
    change = client.post(url, {"outcome": "expired"})
    assert change.status_code in (302, 403)
    record.refresh_from_db()
    assert record.outcome == "delivered"
