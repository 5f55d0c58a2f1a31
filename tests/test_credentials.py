"""Provider credentials per app: encrypted at rest, rotatable, validated, write-only in the admin,
and picked up by the provider registry on the next send without a restart."""

from __future__ import annotations

import io
import json
import secrets
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from relay import checks, crypto
from relay.forms import AppForm
from relay.models import App, ProviderCredentials, Tenant
from relay.providers.base import Outcome, Wakeup
from relay.providers.registry import PROVIDERS, spec_for
from relay.services import provider_registry as registry
from relay.services.credentials import keys, records, selectors, stored, validation
from tests.fakes.apns import (
    FakeApns,
    make_client_certificate,
    make_expired_certificate,
    make_p8_key,
)
from tests.fakes.fcm import FakeFcm, make_service_account, new_private_key_pem
from tests.fakes.wns import FakeWns
from tests.support.admin import login_verified
from tests.support.provider_fakes import change_credentials

KEY_A = Fernet.generate_key().decode()
KEY_B = Fernet.generate_key().decode()
KEY_C = Fernet.generate_key().decode()
TOPIC = "org.example.app"
WNS_SID = "ms-app://s-1-15-2-1111111111-2222222222-3333333333"
WNS_SECRET = "wns-Secret-" + secrets.token_urlsafe(12)


@pytest.fixture(scope="module")
def p8() -> str:
    return make_p8_key()[0]


@pytest.fixture(scope="module")
def service_account_json() -> str:
    return json.dumps(make_service_account("https://oauth2.googleapis.com/token", "project-x"))


@pytest.fixture(scope="module")
def client_certificate() -> tuple[str, str]:
    return make_client_certificate(TOPIC)


@pytest.fixture
def tenant(db) -> Tenant:
    return Tenant.objects.create(name="example")


@pytest.fixture(autouse=True)
def _fresh_registry():
    yield
    registry.close_all()


def raw_row(app: App) -> dict:
    """The stored (encrypted) credentials record of each of the app's providers."""
    with connection.cursor() as cursor:
        cursor.execute(
            'SELECT service, "values" FROM relay_providercredentials WHERE app_id = %s',
            [app.pk],
        )
        return dict(cursor.fetchall())


def make_app(tenant: Tenant, name: str = "conversations", **fields) -> App:
    """An app with credentials stored as given (by their admin form names), not validated."""
    not_after = fields.pop("apns_certificate_not_after", None)
    app = App.objects.create(tenant=tenant, name=name)
    for spec in PROVIDERS:
        own = {
            field.name: fields[validation.form_name(spec, field)]
            for field in spec.fields
            if validation.form_name(spec, field) in fields
        }
        if own:
            records.store(app, spec.service, own)
    if not_after is not None:
        ProviderCredentials.objects.create(
            app=app, service="apns", values="{}", not_after=not_after
        )
    return App.objects.get(pk=app.pk)


def stored_fields(pk: int) -> dict:
    """The app's stored credentials by admin form name; secrets of a record no configured
    key decrypts are UnreadableCredential."""
    app = App.objects.get(pk=pk)
    found: dict = {}
    for spec in PROVIDERS:
        try:
            values = records.values_of(app, spec.service)
        except crypto.CredentialKeyError:
            raw = records.records(app)[spec.service].values
            values = {f.name: raw if f.secret else f.empty() for f in spec.fields}
        found.update({validation.form_name(spec, f): values[f.name] for f in spec.fields})
    record = records.records(app).get("apns")
    found["apns_certificate_not_after"] = record.not_after if record is not None else None
    return found


def pem_of(key) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def secret_marker(pem: str) -> str:
    """A chunk from the middle of a PEM body: proof of the secret, never a header line."""
    body = "".join(line for line in pem.splitlines() if not line.startswith("-----"))
    return body[20:60]


# --- at rest -----------------------------------------------------------------------------------


@pytest.mark.defaults
def test_stored_credentials_are_encrypted_in_the_database(tenant, p8, service_account_json):
    certificate, key = make_client_certificate(TOPIC)
    app = make_app(
        tenant,
        fcm_service_account=service_account_json,
        apns_key=p8,
        apns_certificate=certificate,
        apns_private_key=key,
        wns_secret=WNS_SECRET,
    )
    raw = raw_row(app)
    assert set(raw) == {"fcm", "apns", "wns"}
    for service, value in raw.items():
        assert value.startswith(crypto.PREFIX), service
    text = "".join(raw.values())
    for pem in (p8, certificate, key, json.loads(service_account_json)["private_key"]):
        assert secret_marker(pem) not in text
    assert "private_key" not in text and WNS_SECRET not in text and "BEGIN" not in text

    loaded = stored_fields(app.pk)
    assert loaded["apns_key"] == p8
    assert loaded["wns_secret"] == WNS_SECRET
    assert json.loads(loaded["fcm_service_account"])["project_id"] == "project-x"


@pytest.mark.defaults
def test_any_configured_key_decrypts_and_an_unknown_key_is_reported_not_raised(tenant, p8):
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_A]}):
        app = make_app(tenant, apns_key=p8, apns_key_id="KEYID12345", apns_team_id="TEAMID1234")
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_B, KEY_A]}):
        assert stored_fields(app.pk)["apns_key"] == p8
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_B]}):
        loaded = App.objects.get(pk=app.pk)  # loading the row must not crash
        raw = stored_fields(app.pk)["apns_key"]
        assert isinstance(raw, crypto.UnreadableCredential)
        assert p8 not in repr(raw)
        assert "cannot be decrypted" in stored.credential_fingerprint(raw)
        with pytest.raises(registry.NotConfigured) as caught:
            registry.provider_for(loaded, "apns")
        assert caught.value.code == "APNS_CREDENTIALS_UNREADABLE"
        # Saving the app's other fields keeps the stored ciphertext as it was.
        form = AppForm(
            data={
                "tenant": str(tenant.pk),
                "name": "renamed",
                "public_key": loaded.public_key,
                "payload_options": "{}",
            },
            instance=loaded,
        )
        assert form.is_valid(), form.errors
        form.save()
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_A]}):
        assert stored_fields(app.pk)["apns_key"] == p8


@pytest.mark.defaults
def test_rotation_reencrypts_everything_so_the_old_key_can_go(tenant, p8, service_account_json):
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_A]}):
        first = make_app(tenant, "first", apns_key=p8, wns_secret=WNS_SECRET)
        second = make_app(tenant, "second", fcm_service_account=service_account_json)
        updated = {app.pk: App.objects.get(pk=app.pk).updated for app in (first, second)}
        before = raw_row(first)

    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_B, KEY_A]}):
        assert keys.credential_key_status().rotation_pending == 3  # three records
        out = io.StringIO()
        call_command("rotate_credentials", stdout=out)
        assert "re-encrypted 3 " in out.getvalue()
        status = keys.credential_key_status()
        assert (status.stored, status.rotation_pending, status.unreadable) == (3, 0, 0)
        out = io.StringIO()
        call_command("rotate_credentials", stdout=out)
        assert "re-encrypted 0 " in out.getvalue()

    after = raw_row(first)
    assert after["apns"] != before["apns"]
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_B]}):
        assert stored_fields(first.pk)["apns_key"] == p8
        assert stored_fields(first.pk)["wns_secret"] == WNS_SECRET
        assert stored_fields(second.pk)["fcm_service_account"] == service_account_json
        # The plain values did not change: no provider needs rebuilding.
        assert {app.pk: app.updated for app in App.objects.all()} == updated


@pytest.mark.defaults
def test_rotation_never_overwrites_a_credential_saved_meanwhile(tenant, monkeypatch):
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_A]}):
        app = make_app(tenant, wns_package_sid=WNS_SID, wns_secret="old-secret")
    real_decrypt = crypto.decrypt

    def decrypt_while_an_operator_saves(stored: str) -> str:
        # The admin saves a new secret between rotation's read and its write.
        ProviderCredentials.objects.filter(app=app, service="wns").update(
            values=json.dumps({"package_sid": WNS_SID, "secret": "new-secret"})
        )
        return real_decrypt(stored)

    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_B, KEY_A]}):
        monkeypatch.setattr(crypto, "decrypt", decrypt_while_an_operator_saves)
        assert keys.rotate_credentials() == 0
        monkeypatch.setattr(crypto, "decrypt", real_decrypt)
        assert stored_fields(app.pk)["wns_secret"] == "new-secret"


@pytest.mark.defaults
def test_plain_legacy_values_are_read_and_rotated(tenant):
    app = make_app(tenant, wns_package_sid=WNS_SID)
    plain = json.dumps({"package_sid": WNS_SID, "secret": WNS_SECRET})
    with connection.cursor() as cursor:
        cursor.execute(
            'UPDATE relay_providercredentials SET "values" = %s WHERE app_id = %s', [plain, app.pk]
        )
    assert stored_fields(app.pk)["wns_secret"] == WNS_SECRET
    assert keys.credential_key_status().rotation_pending == 1
    assert keys.rotate_credentials() == 1
    assert raw_row(app)["wns"].startswith(crypto.PREFIX)
    assert stored_fields(app.pk)["wns_secret"] == WNS_SECRET


def check_ids() -> set[str]:
    return {message.id for message in checks.credential_keys_check()}


@pytest.mark.defaults
def test_system_check_reports_unreadable_values_and_pending_rotation(tenant, p8):
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_A]}):
        make_app(tenant, apns_key=p8)
        assert check_ids() == set()
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_C]}):
        assert "relay.W001" in check_ids()
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_C, KEY_A]}):
        assert check_ids() == {"relay.W002"}
        keys.rotate_credentials()
        assert check_ids() == set()
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": ["not-a-fernet-key"]}):
        assert check_ids() == {"relay.E002"}


@pytest.mark.defaults
def test_system_check_warns_about_an_expiring_certificate(tenant):
    make_app(tenant, apns_certificate_not_after=timezone.now() + timedelta(days=5))
    assert "relay.W003" in check_ids()


# --- validation in the admin form --------------------------------------------------------------


def form_data(tenant: Tenant, **fields) -> dict:
    data = {
        "tenant": str(tenant.pk),
        "name": "conversations",
        "public_key": "pk-" + secrets.token_hex(6),
        "payload_options": "{}",
    }
    data.update({key: value for key, value in fields.items() if value is not None})
    return data


def token_auth(p8: str, **extra) -> dict:
    return {
        "apns_topic": TOPIC,
        "apns_key": p8,
        "apns_key_id": "KEYID12345",
        "apns_team_id": "TEAMID1234",
        **extra,
    }


@pytest.mark.defaults
def test_form_saves_valid_credentials(tenant, p8, service_account_json):
    form = AppForm(
        data=form_data(
            tenant,
            fcm_service_account=service_account_json,
            wns_package_sid=WNS_SID,
            wns_secret=WNS_SECRET,
            **token_auth(p8),
        )
    )
    assert form.is_valid(), form.errors
    app = stored_fields(form.save().pk)
    assert app["apns_key"].strip() == p8.strip()
    assert app["wns_secret"] == WNS_SECRET
    assert json.loads(app["fcm_service_account"])["project_id"] == "project-x"
    assert app["apns_certificate_not_after"] is None


def expired_pair() -> tuple[str, str]:
    return make_expired_certificate(TOPIC)


def p384_key() -> str:
    return pem_of(ec.generate_private_key(ec.SECP384R1()))


@pytest.mark.defaults
@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        (lambda p8: token_auth(p384_key()), "apns_key", "EC P-256 (.p8) key, not an EC P-384"),
        (lambda p8: token_auth(new_private_key_pem()), "apns_key", "not an RSA 2048-bit key"),
        (lambda p8: token_auth("-----BEGIN PRIVATE KEY-----\nAAAA\n"), "apns_key", "not a PEM"),
        (
            lambda p8: token_auth(p8, apns_key_id="short"),
            "apns_key_id",
            "10 capital letters or digits",
        ),
        (lambda p8: token_auth(p8, apns_topic=""), "apns_topic", "bundle id"),
        (
            lambda p8: {
                "apns_topic": TOPIC,
                "apns_certificate": "".join(make_expired_certificate()),
            },
            "apns_certificate",
            "expired on",
        ),
        (
            lambda p8: {
                "apns_topic": TOPIC,
                "apns_certificate": make_client_certificate(TOPIC)[0],
                "apns_private_key": make_client_certificate(TOPIC)[1],
            },
            "apns_private_key",
            "does not belong to the APNs certificate",
        ),
        (
            lambda p8: {"apns_topic": TOPIC, "apns_certificate": make_client_certificate()[0]},
            "apns_private_key",
            "needs the certificate's private key",
        ),
        (
            lambda p8: {**token_auth(p8), "apns_certificate": make_client_certificate()[0]},
            "apns_key",
            "not both",
        ),
        (lambda p8: {"fcm_service_account": "{not json"}, "fcm_service_account", "not valid JSON"),
        (
            lambda p8: {"fcm_service_account": json.dumps({"type": "service_account"})},
            "fcm_service_account",
            "lacks project_id",
        ),
        (
            lambda p8: {"wns_package_sid": "s-1-15-2-123", "wns_secret": "x"},
            "wns_package_sid",
            "ms-app://",
        ),
        (lambda p8: {"wns_package_sid": WNS_SID}, "wns_secret", "required"),
        (
            lambda p8: {**token_auth(p8), "apns_endpoint": "ftp://apns.example"},
            "apns_endpoint",
            "host[:port]",
        ),
        (
            lambda p8: {**token_auth(p8), "apns_ca_certificate": "not a certificate"},
            "apns_ca_certificate",
            "PEM certificates",
        ),
    ],
    ids=[
        "p384-key",
        "rsa-key",
        "garbage-key",
        "bad-key-id",
        "no-topic",
        "expired-certificate",
        "key-of-another-certificate",
        "certificate-without-key",
        "key-and-certificate",
        "service-account-not-json",
        "service-account-incomplete",
        "bad-package-sid",
        "sid-without-secret",
        "bad-endpoint",
        "bad-ca",
    ],
)
def test_form_rejects_unusable_credentials(tenant, p8, fields, field, words):
    form = AppForm(data=form_data(tenant, **fields(p8)))
    assert not form.is_valid()
    assert field in form.errors, form.errors
    assert words in " ".join(form.errors[field])
    assert App.objects.count() == 0


@pytest.mark.defaults
def test_form_never_renders_stored_or_posted_secrets(tenant, p8, service_account_json):
    certificate, key = make_client_certificate(TOPIC)
    app = make_app(
        tenant,
        apns_topic=TOPIC,
        fcm_service_account=service_account_json,
        apns_certificate=certificate,
        apns_private_key=key,
        wns_package_sid=WNS_SID,
        wns_secret=WNS_SECRET,
    )
    markers = [
        secret_marker(json.loads(service_account_json)["private_key"]),
        secret_marker(certificate),
        secret_marker(key),
        WNS_SECRET,
        "BEGIN",
        "private_key_id",
    ]
    html = str(AppForm(instance=App.objects.get(pk=app.pk)))
    for marker in markers:
        assert marker not in html
    expected = stored.credential_fingerprint(WNS_SECRET)
    assert expected.startswith("set · sha256 ")
    assert expected in html

    # A rejected post is shown again without the secrets that were typed in.
    other_key = make_client_certificate(TOPIC)[1]
    data = form_data(tenant, apns_topic=TOPIC, apns_private_key=other_key, wns_secret=" x ")
    data["name"] = app.name
    bound = AppForm(data=data, instance=App.objects.get(pk=app.pk))
    assert not bound.is_valid()
    assert "apns_private_key" in bound.errors
    html = str(bound)
    assert secret_marker(other_key) not in html
    for marker in markers:
        assert marker not in html


@pytest.mark.defaults
def test_empty_inputs_keep_stored_secrets_and_clear_removes_one(tenant, p8, service_account_json):
    app = make_app(
        tenant,
        fcm_service_account=service_account_json,
        wns_package_sid=WNS_SID,
        wns_secret=WNS_SECRET,
        **token_auth(p8),
    )
    data = form_data(tenant, wns_package_sid=WNS_SID, **token_auth(""))
    data.update(name=app.name, public_key=app.public_key, apns_key="")
    form = AppForm(data=data, instance=App.objects.get(pk=app.pk))
    assert form.is_valid(), form.errors
    assert "apns_key" not in form.changed_data
    form.save()
    kept = stored_fields(app.pk)
    assert (kept["apns_key"], kept["wns_secret"]) == (p8, WNS_SECRET)
    assert kept["fcm_service_account"] == service_account_json

    form = AppForm(
        data={**data, "fcm_service_account_clear": "on"}, instance=App.objects.get(pk=app.pk)
    )
    assert form.is_valid(), form.errors
    form.save()
    cleared = stored_fields(app.pk)
    assert cleared["fcm_service_account"] == ""
    assert cleared["apns_key"] == p8
    assert set(raw_row(app)) == {"apns", "wns"}  # nothing left of FCM: its record is gone

    form = AppForm(
        data={**data, "apns_key_clear": "on", "apns_key": p8}, instance=App.objects.get(pk=app.pk)
    )
    assert not form.is_valid()
    assert "Either remove the stored value or enter a new one" in str(form.errors)


@pytest.mark.defaults
def test_form_asks_for_a_credential_no_configured_key_decrypts(tenant):
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_A]}):
        app = make_app(tenant, wns_package_sid=WNS_SID, wns_secret=WNS_SECRET)
    with override_settings(RELAY={**settings.RELAY, "CREDENTIAL_KEYS": [KEY_B]}):
        stored = App.objects.get(pk=app.pk)
        data = form_data(tenant, wns_package_sid=WNS_SID)
        data.update(name=app.name, public_key=app.public_key)
        form = AppForm(data=data, instance=stored)
        assert not form.is_valid()
        assert "cannot be decrypted" in str(form.errors["wns_secret"])
        form = AppForm(data={**data, "wns_secret": "re-entered"}, instance=stored)
        assert form.is_valid(), form.errors
        form.save()
        assert stored_fields(app.pk)["wns_secret"] == "re-entered"


@pytest.mark.defaults
def test_form_takes_uploaded_files_and_records_the_certificate_expiry(tenant):
    certificate, key = make_client_certificate(TOPIC)
    account = make_service_account("https://oauth2.googleapis.com/token", "uploaded")
    files = {
        "fcm_service_account_file": SimpleUploadedFile("sa.json", json.dumps(account).encode()),
        "apns_certificate_file": SimpleUploadedFile("cert.pem", certificate.encode()),
        "apns_private_key_file": SimpleUploadedFile("key.pem", key.encode()),
    }
    form = AppForm(data=form_data(tenant, apns_topic=TOPIC), files=files)
    assert form.is_valid(), form.errors
    app = stored_fields(form.save().pk)
    assert json.loads(app["fcm_service_account"])["project_id"] == "uploaded"
    assert app["apns_private_key"] == key.strip()
    not_after = app["apns_certificate_not_after"]
    assert not_after is not None
    assert timedelta(days=360) < not_after - timezone.now() < timedelta(days=366)

    binary = {"apns_key_file": SimpleUploadedFile("AuthKey.p8", b"\xff\xfe\x00binary")}
    form = AppForm(data=form_data(tenant, name="other", apns_topic=TOPIC), files=binary)
    assert not form.is_valid()
    assert "not text" in str(form.errors["apns_key_file"])


# --- expiry ------------------------------------------------------------------------------------


@pytest.mark.defaults
def test_certificates_expiring_selects_soon_and_already_expired_ones(tenant):
    now = timezone.now()
    expiries = {
        "expired": now - timedelta(days=1),
        "soon": now + timedelta(days=10),
        "later": now + timedelta(days=60),
        "token-auth": None,
    }
    for name, not_after in expiries.items():
        make_app(tenant, name, apns_certificate_not_after=not_after)
    assert [app.name for app in selectors.certificates_expiring()] == ["expired", "soon"]
    assert [app.name for app in selectors.certificates_expiring(within_days=90)] == [
        "expired",
        "soon",
        "later",
    ]
    soon = App.objects.get(name="soon")
    assert "expires on" in selectors.expiry_warning(app=soon)
    assert selectors.expiry_warning(app=App.objects.get(name="later")) == ""


@pytest.fixture
def admin_client_plain_static(client, admin_user, settings):
    login_verified(client, admin_user)  # past the second step, as the admin requires
    admin_client = client
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }
    return admin_client


def test_admin_shows_fingerprints_and_warns_before_the_certificate_expires(
    tenant, admin_client_plain_static
):
    client = admin_client_plain_static
    certificate, key = make_client_certificate(TOPIC, not_after=timezone.now() + timedelta(days=12))
    app = make_app(
        tenant,
        apns_topic=TOPIC,
        apns_certificate=certificate,
        apns_private_key=key,
        wns_package_sid=WNS_SID,
        wns_secret=WNS_SECRET,
    )

    page = client.get(f"/admin/relay/app/{app.pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "expires on" in html  # the warning message
    assert stored.credential_fingerprint(WNS_SECRET) in html
    for marker in (secret_marker(certificate), secret_marker(key), WNS_SECRET, "BEGIN"):
        assert marker not in html
    assert 'enctype="multipart/form-data"' in html

    assert client.get("/admin/relay/app/add/").status_code == 200
    listing = client.get("/admin/relay/app/").content.decode()
    assert "⚠ expires" in listing
    assert WNS_SECRET not in listing


def test_admin_saves_a_new_service_account_without_showing_it(
    tenant, admin_client_plain_static, service_account_json
):
    client = admin_client_plain_static
    app = make_app(tenant)
    data = form_data(tenant, fcm_service_account=service_account_json)
    data.update(name=app.name, public_key=app.public_key)
    response = client.post(f"/admin/relay/app/{app.pk}/change/", data)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert stored_fields(app.pk)["fcm_service_account"] == service_account_json
    html = client.get(f"/admin/relay/app/{app.pk}/change/").content.decode()
    assert secret_marker(json.loads(service_account_json)["private_key"]) not in html
    assert "FCM project: project-x" in html


# --- the registry: credentials in effect on the next send --------------------------------------


def wakeup(token: str) -> Wakeup:
    return Wakeup(push_id=str(uuid.uuid4()), token=token, account="a" * 40)


@pytest.fixture(scope="module")
def fake_fcm():
    with FakeFcm() as fake:
        yield fake


@pytest.mark.defaults
def test_a_credentials_change_takes_effect_on_the_next_send(tenant, fake_fcm):
    fake_fcm.reset()
    account_a = fake_fcm.service_account("project-a")
    account_b = fake_fcm.service_account("project-b")
    app = make_app(tenant, fcm_service_account=json.dumps(account_a), fcm_endpoint=fake_fcm.url)

    first = registry.provider_for(App.objects.get(pk=app.pk), "fcm")
    assert first.send(wakeup("fcm-token-1")).outcome == Outcome.DELIVERED
    assert registry.provider_for(App.objects.get(pk=app.pk), "fcm") is first

    change_credentials(App.objects.get(pk=app.pk), "fcm", service_account=json.dumps(account_b))

    second = registry.provider_for(App.objects.get(pk=app.pk), "fcm")
    assert second is not first
    assert second.send(wakeup("fcm-token-2")).outcome == Outcome.DELIVERED
    assert [sent.project for sent in fake_fcm.requests] == ["project-a", "project-b"]
    assert first.send(wakeup("fcm-token-3")).error_code == "CLOSED"  # the old one was closed


@pytest.mark.defaults
def test_registry_builds_apns_from_the_app_with_its_own_trust_store(tenant):
    key, public_key = make_p8_key()
    with FakeApns(topic=TOPIC, public_key=public_key) as fake:
        app = make_app(
            tenant,
            apns_topic=TOPIC,
            apns_key=key,
            apns_key_id=fake.key_id,
            apns_team_id=fake.team_id,
            apns_endpoint=fake.endpoint,
            apns_ca_certificate=Path(fake.ca_file).read_text(),
        )
        provider = registry.provider_for(App.objects.get(pk=app.pk), "apns")
        token = secrets.token_hex(32)
        assert provider.send(wakeup(token)).outcome == Outcome.DELIVERED
        assert len(fake.requests_for(token)) == 1


@pytest.mark.defaults
def test_registry_builds_wns_with_channel_hosts_from_the_app_or_the_settings(tenant, settings):
    with FakeWns(client_id=WNS_SID, client_secret=WNS_SECRET) as fake:
        app = make_app(
            tenant,
            wns_package_sid=WNS_SID,
            wns_secret=WNS_SECRET,
            wns_token_url=fake.token_url,
        )
        # The default allow-list is *.notify.windows.com: the fake's loopback is refused.
        result = registry.provider_for(App.objects.get(pk=app.pk), "wns").send(
            wakeup(fake.channel_uri("one"))
        )
        assert result.error_code == "CHANNEL_HOST_NOT_ALLOWED"

        change_credentials(app, "wns", channel_hosts=f"{fake.host_pattern}\n*.notify.windows.com")
        provider = registry.provider_for(App.objects.get(pk=app.pk), "wns")
        assert provider.send(wakeup(fake.channel_uri("one"))).outcome == Outcome.DELIVERED

        registry.close_all()
        settings.RELAY = {**settings.RELAY, "WNS_CHANNEL_HOSTS": [fake.host_pattern]}
        change_credentials(App.objects.get(pk=app.pk), "wns", channel_hosts="")
        provider = registry.provider_for(App.objects.get(pk=app.pk), "wns")
        assert provider.send(wakeup(fake.channel_uri("two"))).outcome == Outcome.DELIVERED
        assert len(fake.requests_for("two")) == 1


@pytest.mark.defaults
def test_registry_names_missing_and_bad_credentials(tenant):
    app = make_app(tenant)
    for service, code in (
        ("fcm", "FCM_NOT_CONFIGURED"),
        ("apns", "APNS_NOT_CONFIGURED"),
        ("wns", "WNS_NOT_CONFIGURED"),
    ):
        with pytest.raises(registry.NotConfigured) as caught:
            registry.provider_for(app, service)
        assert caught.value.code == code

    # Stored around the validation (e.g. by a script): refused when the provider is built.
    bad = make_app(
        tenant,
        "bad",
        fcm_service_account='{"type": "service_account"}',
        apns_topic=TOPIC,
        apns_key=new_private_key_pem(),
        apns_key_id="KEYID12345",
        apns_team_id="TEAMID1234",
        wns_package_sid="not-a-sid",
        wns_secret="x",
    )
    for service in ("fcm", "apns", "wns"):
        with pytest.raises(registry.NotConfigured) as caught:
            registry.provider_for(bad, service)
        assert caught.value.code == f"{service.upper()}_BAD_CREDENTIALS"


@pytest.mark.defaults
def test_credentials_turning_bad_drop_the_cached_provider(tenant, fake_fcm):
    account = fake_fcm.service_account("project-c")
    app = make_app(tenant, fcm_service_account=json.dumps(account), fcm_endpoint=fake_fcm.url)
    first = registry.provider_for(App.objects.get(pk=app.pk), "fcm")
    change_credentials(App.objects.get(pk=app.pk), "fcm", service_account="{}")
    with pytest.raises(registry.NotConfigured):
        registry.provider_for(App.objects.get(pk=app.pk), "fcm")
    assert first.send(wakeup("fcm-token")).error_code == "CLOSED"


def test_a_running_worker_uses_new_credentials_without_restart(
    transactional_db, fake_fcm, send_queue
):
    from django.conf import settings

    from relay.models import Component, Registration
    from relay.services import queue
    from tests.support.processes import start_worker
    from tests.support.waiting import wait_until

    fake_fcm.reset()
    account_a = fake_fcm.service_account("worker-a")
    account_b = fake_fcm.service_account("worker-b")
    tenant = Tenant.objects.create(name="worker")
    app = make_app(tenant, fcm_service_account=json.dumps(account_a), fcm_endpoint=fake_fcm.url)
    component = Component.objects.create(tenant=tenant, app=app, jid="push.worker.test", secret="s")
    registration = Registration.objects.create(
        app=app,
        component=component,
        service="fcm",
        device_hash="d" * 40,
        account_domain="example.org",
        token="fcm-worker-token",
        node="node-1",
        secret="secret-1",
    )

    def send() -> None:
        queue.enqueue_send(
            queue.SendJob(
                push_id=str(uuid.uuid4()),
                registration_id=registration.pk,
                publishing_domain="example.org",
                important=True,
                received=timezone.now().isoformat(),
            )
        )

    worker = start_worker(CREDENTIAL_KEYS=",".join(settings.RELAY["CREDENTIAL_KEYS"]))
    try:
        send()
        wait_until(lambda: fake_fcm.send_count >= 1, timeout=30)
        change_credentials(app, "fcm", service_account=json.dumps(account_b))
        send()
        wait_until(lambda: fake_fcm.send_count >= 2, timeout=30)
        assert worker.alive()
        assert [sent.project for sent in fake_fcm.requests] == ["worker-a", "worker-b"]
    finally:
        worker.stop()
    assert WNS_SECRET not in worker.log_text()
    assert account_b["private_key"] not in worker.log_text()


@pytest.mark.defaults
@pytest.mark.parametrize("variable", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"])
def test_the_fcm_ca_bundle_is_the_configured_one(tenant, fake_fcm, tmp_path, monkeypatch, variable):
    """The CA bundle's settings reach the (Django-free) provider from the registry, as
    relay.conf has them: not from the process's environment."""
    bundle = tmp_path / "ca.pem"
    bundle.write_text("")  # read when a connection is made: none is here
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    app = make_app(
        tenant,
        fcm_service_account=json.dumps(fake_fcm.service_account("project-ca")),
        fcm_endpoint=fake_fcm.url,
    )
    names = {"REQUESTS_CA_BUNDLE": "", "CURL_CA_BUNDLE": "", variable: str(bundle)}
    with override_settings(RELAY={**settings.RELAY, **names}):
        provider = registry.provider_for(App.objects.get(pk=app.pk), "fcm")
    assert provider.route.ca_bundle == str(bundle)  # type: ignore[attr-defined]
    assert provider._token_session.verify == str(bundle)  # type: ignore[attr-defined]
    default = registry.build(App.objects.get(pk=app.pk), spec_for("fcm"))
    try:
        assert default.route.ca_bundle != str(bundle)  # type: ignore[attr-defined]
    finally:
        default.close()
