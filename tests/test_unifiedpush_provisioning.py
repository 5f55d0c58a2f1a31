"""Provisioning UnifiedPush components: `unifiedpush:` in load_tenants, `app` optional."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import IntegrityError, transaction

from relay.models import App, Component, Tenant
from relay.services.provisioning import ProvisioningError, load_tenants
from relay.unifiedpush.models import ComponentSettings, serves

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]

DOCUMENT = """
tenants:
  - name: example
    apps:
      - name: conversations
    components:
      - jid: up.example.org
        secret: component-secret-0123456789
        host: 127.0.0.1
        port: 5347
        unifiedpush:
          endpoint_url: https://push.example.org
          token_lifetime_days: 14
      - jid: both.example.org
        secret: component-secret-0123456789
        app: conversations
        unifiedpush:
          endpoint_url: https://push.example.org/relay/
      - jid: p2.example.org
        secret: component-secret-0123456789
        app: conversations
"""


def test_components_serve_unifiedpush_p2_or_both(tmp_path: Path):
    report = load_tenants(DOCUMENT, base_dir=tmp_path)
    assert report.counts["component created"] == 3
    assert report.counts["UnifiedPush created"] == 2
    up = Component.objects.get(jid="up.example.org")
    assert up.app is None and serves(up) and not up.serves_p2
    assert up.unifiedpush_settings.endpoint_url == "https://push.example.org"
    assert up.unifiedpush_settings.token_lifetime_days == 14
    both = Component.objects.get(jid="both.example.org")
    assert both.serves_p2 and serves(both)
    assert both.unifiedpush_settings.token_lifetime_days == 7  # the default
    p2 = Component.objects.get(jid="p2.example.org")
    assert p2.serves_p2 and not serves(p2)
    again = load_tenants(DOCUMENT, base_dir=tmp_path)
    assert again.counts["component unchanged"] == 3
    assert again.counts["UnifiedPush unchanged"] == 2


def test_leaving_unifiedpush_out_turns_it_off(tmp_path: Path):
    load_tenants(DOCUMENT, base_dir=tmp_path)
    text = DOCUMENT.replace(
        "        unifiedpush:\n          endpoint_url: https://push.example.org/relay/\n", ""
    )
    report = load_tenants(text, base_dir=tmp_path)
    assert report.counts["UnifiedPush removed"] == 1
    assert report.counts["component unchanged"] == 3
    assert "UnifiedPush both.example.org: removed" in [
        change.describe() for change in report.changes
    ]
    assert not serves(Component.objects.get(jid="both.example.org"))
    assert ComponentSettings.objects.count() == 1


@pytest.mark.parametrize(
    "replace, message",
    [
        (
            (
                "        app: conversations\n        unifiedpush:\n          endpoint_url: "
                "https://push.example.org/relay/\n",
                "",
            ),
            r"components\[1\]: give app \(p2 commands\), unifiedpush, or both",
        ),
        (
            ("https://push.example.org\n", "ftp://push.example.org\n"),
            r"components\[0\]\.unifiedpush\.endpoint_url: ",
        ),
        (
            ("https://push.example.org\n", "https://push.example.org/?a=b\n"),
            r"components\[0\]\.unifiedpush\.endpoint_url: Give a base URL without user, query",
        ),
        (
            ("token_lifetime_days: 14", "token_lifetime_days: 0"),
            r"components\[0\]\.unifiedpush\.token_lifetime_days: expected a number of days",
        ),
        (
            ("token_lifetime_days: 14", "token_lifetime_days: soon"),
            r"components\[0\]\.unifiedpush\.token_lifetime_days",
        ),
        (
            ("token_lifetime_days: 14", "lifetime: 14"),
            r"components\[0\]\.unifiedpush\.lifetime: unknown key",
        ),
        (
            ("          endpoint_url: https://push.example.org\n", ""),
            r"components\[0\]\.unifiedpush\.endpoint_url: required",
        ),
    ],
)
def test_mistakes_are_named_and_nothing_applies(tmp_path: Path, replace, message):
    old, new = replace
    assert old in DOCUMENT
    with pytest.raises(ProvisioningError, match=message):
        load_tenants(DOCUMENT.replace(old, new, 1), base_dir=tmp_path)
    assert not Tenant.objects.exists()


@pytest.mark.parametrize(
    "values",
    [{"endpoint_url": ""}, {"endpoint_url": "https://p.example", "token_lifetime_days": 0}],
)
def test_the_database_refuses_settings_that_serve_nothing(values):
    tenant = Tenant.objects.create(name="t")
    app = App.objects.create(tenant=tenant, name="a")
    component = Component.objects.create(tenant=tenant, app=app, jid="p2.example.org", secret="x")
    with pytest.raises(IntegrityError), transaction.atomic():
        ComponentSettings.objects.create(component=component, **values)
    assert not serves(Component.objects.get(pk=component.pk))
