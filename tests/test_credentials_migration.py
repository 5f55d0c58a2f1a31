"""Migration 0014 moves every provider's credentials from App's columns into one encrypted
record per app and provider, losing nothing: values under a rotated (older) key included, each
written again under the current key; and it goes back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.conf import settings
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import override_settings

from relay import crypto
from relay.models import App, ProviderCredentials
from relay.services.credentials import records
from tests.fakes.apns import make_client_certificate, make_p8_key
from tests.fakes.fcm import make_service_account

pytestmark = [pytest.mark.defaults, pytest.mark.django_db(transaction=True)]

BEFORE = ("relay", "0016_unifiedpush_settings_leave_the_component")
AFTER = ("relay", "0017_provider_credentials")
OLD_KEY = Fernet.generate_key().decode()
NEW_KEY = Fernet.generate_key().decode()
TOPIC = "org.example.app"
WNS_SID = "ms-app://s-1-15-2-1111111111-2222222222-3333333333"
NOT_AFTER = datetime(2031, 5, 4, 3, 2, 1, tzinfo=UTC)


def keys(*names: str) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": list(names)})


def migrate(target: tuple[str, str]) -> Any:
    """Migrate to `target`; the historical models there."""
    executor = MigrationExecutor(connection)
    executor.migrate([target])
    return executor.loader.project_state([target]).apps


@pytest.fixture
def at_0013() -> Iterator[Any]:
    """The database at 0013, brought back to the newest migration afterwards."""
    historical = migrate(BEFORE)
    try:
        yield historical
    finally:
        with keys(NEW_KEY, OLD_KEY):  # what the tests stored must move along
            executor = MigrationExecutor(connection)
            executor.migrate(executor.loader.graph.leaf_nodes())


def make_apps(historical: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """Apps with every provider's columns filled, under an old key and under the new one;
    what each record must hold afterwards, by app name and service."""
    OldApp = historical.get_model("relay", "App")
    Tenant = historical.get_model("relay", "Tenant")
    tenant = Tenant.objects.create(name="example")
    p8 = make_p8_key()[0]
    certificate, key = make_client_certificate(TOPIC)
    service_account = json.dumps(make_service_account("https://oauth2.example/token", "proj"))
    expected: dict[str, dict[str, dict[str, Any]]] = {}
    with keys(OLD_KEY):  # stored before the key was rotated
        OldApp.objects.create(
            tenant=tenant,
            name="token-auth",
            fcm_service_account=service_account,
            fcm_endpoint="https://fcm.example",
            apns_topic=TOPIC,
            apns_sandbox=True,
            apns_key=p8,
            apns_key_id="KEYID12345",
            apns_team_id="TEAMID1234",
            apns_endpoint="apns.example:2197",
            apns_ca_certificate="-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----",
            wns_package_sid=WNS_SID,
            wns_secret="wns-secret-old-key",
            wns_token_url="https://login.example/token",
            wns_channel_hosts="*.notify.windows.com\nwns.example.net",
        )
    expected["token-auth"] = {
        "fcm": {"service_account": service_account, "endpoint": "https://fcm.example"},
        "apns": {
            "topic": TOPIC,
            "sandbox": True,
            "key": p8,
            "key_id": "KEYID12345",
            "team_id": "TEAMID1234",
            "certificate": "",
            "private_key": "",
            "endpoint": "apns.example:2197",
            "ca_certificate": "-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----",
        },
        "wns": {
            "package_sid": WNS_SID,
            "secret": "wns-secret-old-key",
            "token_url": "https://login.example/token",
            "channel_hosts": "*.notify.windows.com\nwns.example.net",
        },
    }
    with keys(NEW_KEY, OLD_KEY):  # stored after it
        OldApp.objects.create(
            tenant=tenant,
            name="certificate-auth",
            apns_topic=TOPIC,
            apns_certificate=certificate,
            apns_private_key=key,
            apns_certificate_not_after=NOT_AFTER,
            wns_channel_hosts="127.0.0.1:*",  # no secret: kept all the same
        )
        OldApp.objects.create(tenant=tenant, name="nothing")
    expected["certificate-auth"] = {
        "apns": {
            "topic": TOPIC,
            "sandbox": False,
            "key": "",
            "key_id": "",
            "team_id": "",
            "certificate": certificate,
            "private_key": key,
            "endpoint": "",
            "ca_certificate": "",
        },
        "wns": {"package_sid": "", "secret": "", "token_url": "", "channel_hosts": "127.0.0.1:*"},
    }
    expected["nothing"] = {}
    return expected


def raw_records() -> dict[tuple[str, str], str]:
    with connection.cursor() as cursor:
        cursor.execute(
            'SELECT a.name, p.service, p."values" FROM relay_providercredentials p'
            " JOIN relay_app a ON a.id = p.app_id"
        )
        return {(name, service): value for name, service, value in cursor.fetchall()}


def test_every_credential_moves_into_its_record_under_the_current_key(at_0013):
    expected = make_apps(at_0013)
    with keys(NEW_KEY, OLD_KEY):
        migrate(AFTER)
        for app in App.objects.all():
            stored = {service: records.values_of(app, service) for service in expected[app.name]}
            assert stored == expected[app.name], app.name
            assert set(records.records(app)) == set(expected[app.name])
        record = ProviderCredentials.objects.get(app__name="certificate-auth", service="apns")
        assert record.not_after == NOT_AFTER
        assert (
            ProviderCredentials.objects.get(app__name="token-auth", service="apns").not_after
            is None
        )
    raw = raw_records()
    assert len(raw) == 5
    for where, value in raw.items():
        assert value.startswith(crypto.PREFIX), where
        assert "wns-secret" not in value and "BEGIN" not in value
    with keys(NEW_KEY):  # the old key can go: nothing needs it any more
        for app in App.objects.all():
            for service, values in expected[app.name].items():
                assert records.values_of(app, service) == values


def test_going_back_restores_the_columns(at_0013):
    expected = make_apps(at_0013)
    with keys(NEW_KEY, OLD_KEY):
        migrate(AFTER)
        historical = migrate(BEFORE)
        OldApp = historical.get_model("relay", "App")
        app = OldApp.objects.get(name="token-auth")
        assert app.apns_key == expected["token-auth"]["apns"]["key"]
        assert app.wns_secret == "wns-secret-old-key"
        assert app.fcm_service_account == expected["token-auth"]["fcm"]["service_account"]
        assert app.apns_sandbox is True
        other = OldApp.objects.get(name="certificate-auth")
        assert other.apns_private_key == expected["certificate-auth"]["apns"]["private_key"]
        assert other.apns_certificate_not_after == NOT_AFTER
        assert other.wns_channel_hosts == "127.0.0.1:*"


def test_a_value_no_key_decrypts_stops_the_migration_and_changes_nothing(at_0013):
    make_apps(at_0013)
    with keys(NEW_KEY), pytest.raises(RuntimeError) as stopped:  # the old key is missing
        migrate(AFTER)
    assert "cannot be decrypted" in str(stopped.value)
    assert "wns-secret" not in str(stopped.value)
    executor = MigrationExecutor(connection)
    assert AFTER not in executor.loader.applied_migrations
    with keys(NEW_KEY, OLD_KEY):  # with the key back, it goes through
        migrate(AFTER)
        app = App.objects.get(name="token-auth")
        assert records.values_of(app, "wns")["secret"] == "wns-secret-old-key"
