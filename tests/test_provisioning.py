"""`load_tenants`: tenants, apps with FCM, APNs and WNS credentials, components; idempotent, and
every error names its place in the file."""

from __future__ import annotations

import io
import json
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from relay import crypto
from relay.models import App, Component, ProviderCredentials, Tenant
from relay.services.credentials.records import values_of as values
from relay.services.provisioning import ProvisioningError, load_tenants
from tests.fakes.apns import (
    CertificateAuthority,
    make_client_certificate,
    make_expired_certificate,
    make_p8_key,
)
from tests.fakes.fcm import make_service_account

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]

TOPIC = "eu.siacs.conversations"
WNS_SID = "ms-app://s-1-15-2-1111111111-2222222222-3333333333"
WNS_SECRET = "wns-provisioned-secret"

DOCUMENT = """
tenants:
  - name: example
    display_name: Example Hosting
    apps:
      - name: conversations
        fcm:
          service_account_file: sa.json
        apns:
          key_file: keys/AuthKey_ABC123DEFG.p8
          key_id: ABC123DEFG
          team_id: TEAM123456
          topic: eu.siacs.conversations
          sandbox: false
          endpoint: https://api.push.apple.com
          ca_file: apns-ca.pem
        wns:
          package_sid: {sid}
          secret: {secret}
          token_url: https://login.live.com/accesstoken.srf
          channel_hosts: ["*.notify.windows.com", "wns.example.net"]
    components:
      - jid: push.example.org
        app: conversations
        secret: component-secret
"""


@pytest.fixture
def files(tmp_path: Path) -> Path:
    account = make_service_account("https://oauth2.googleapis.com/token", "provisioned")
    (tmp_path / "sa.json").write_text(json.dumps(account))
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "AuthKey_ABC123DEFG.p8").write_text(make_p8_key()[0])
    (tmp_path / "apns-ca.pem").write_text(CertificateAuthority.create("Test APNs CA").pem)
    return tmp_path


def document(**replace: str) -> str:
    text = DOCUMENT.format(sid=WNS_SID, secret=WNS_SECRET)
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_loading_twice_creates_then_changes_nothing(files):
    first = load_tenants(document(), base_dir=files)
    assert first.counts == {"tenant created": 1, "app created": 1, "component created": 1}
    app = App.objects.get(name="conversations")
    updated = app.updated

    second = load_tenants(document(), base_dir=files)
    assert second.counts == {"tenant unchanged": 1, "app unchanged": 1, "component unchanged": 1}
    assert App.objects.get(pk=app.pk).updated == updated

    apns, wns, fcm = (values(app, service) for service in ("apns", "wns", "fcm"))
    assert apns["key"] == (files / "keys" / "AuthKey_ABC123DEFG.p8").read_text().strip()
    assert (apns["key_id"], apns["team_id"], apns["topic"]) == (
        "ABC123DEFG",
        "TEAM123456",
        TOPIC,
    )
    assert apns["sandbox"] is False
    assert apns["endpoint"] == "https://api.push.apple.com"
    assert apns["ca_certificate"] == (files / "apns-ca.pem").read_text().strip()
    assert (wns["package_sid"], wns["secret"]) == (WNS_SID, WNS_SECRET)
    assert wns["channel_hosts"].splitlines() == ["*.notify.windows.com", "wns.example.net"]
    assert json.loads(fcm["service_account"])["project_id"] == "provisioned"
    with connection.cursor() as cursor:
        query = 'SELECT "values" FROM relay_providercredentials WHERE app_id = %s AND service = %s'
        cursor.execute(query, [app.pk, "apns"])
        [raw_key] = cursor.fetchone()
        cursor.execute(query, [app.pk, "wns"])
        [raw_secret] = cursor.fetchone()
    assert raw_key.startswith(crypto.PREFIX) and "PRIVATE KEY" not in raw_key
    assert raw_secret.startswith(crypto.PREFIX) and WNS_SECRET not in raw_secret


def test_a_changed_credential_updates_the_app(files):
    load_tenants(document(), base_dir=files)
    report = load_tenants(document(**{WNS_SECRET: "rotated-secret"}), base_dir=files)
    assert report.counts["app updated"] == 1
    assert values(App.objects.get(name="conversations"), "wns")["secret"] == "rotated-secret"


def test_switching_apns_to_certificate_auth_removes_the_key_and_records_expiry(files):
    load_tenants(document(), base_dir=files)
    certificate, key = make_client_certificate(TOPIC)
    (files / "apns.crt").write_text(certificate)
    (files / "apns.key").write_text(key)
    text = document(
        **{
            "key_file: keys/AuthKey_ABC123DEFG.p8": "certificate_file: apns.crt\n"
            "          private_key_file: apns.key",
            "          key_id: ABC123DEFG\n": "",
            "          team_id: TEAM123456\n": "",
        }
    )
    assert load_tenants(text, base_dir=files).counts["app updated"] == 1
    app = App.objects.get(name="conversations")
    apns = values(app, "apns")
    assert (apns["key"], apns["key_id"], apns["team_id"]) == ("", "", "")
    assert apns["certificate"] == certificate.strip()
    assert apns["private_key"] == key.strip()
    not_after = app.credentials.get(service="apns").not_after
    assert timedelta(days=360) < not_after - timezone.now()
    assert load_tenants(text, base_dir=files).counts["app unchanged"] == 1


def test_sections_left_out_keep_what_is_stored(files):
    load_tenants(document(), base_dir=files)
    minimal = "tenants:\n  - name: example\n    apps:\n      - name: conversations\n"
    assert load_tenants(minimal, base_dir=files).counts["app unchanged"] == 1
    assert values(App.objects.get(name="conversations"), "wns")["secret"] == WNS_SECRET


def p384_pem() -> str:
    return (
        ec.generate_private_key(ec.SECP384R1())
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )


def expired_certificate_files(folder: Path) -> dict[str, str]:
    certificate, key = make_expired_certificate(TOPIC)
    (folder / "old.crt").write_text(certificate)
    (folder / "old.key").write_text(key)
    return {
        "key_file: keys/AuthKey_ABC123DEFG.p8": "certificate_file: old.crt\n"
        "          private_key_file: old.key"
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda folder: {"keys/AuthKey_ABC123DEFG.p8": "keys/missing.p8"},
            "tenants[0].apps[0].apns.key_file: cannot read keys/missing.p8",
        ),
        (
            lambda folder: (
                (folder / "keys" / "AuthKey_ABC123DEFG.p8").write_text(p384_pem()) and {}
            ),
            "tenants[0].apps[0].apns.key_file: The APNs key must be an EC P-256 (.p8) key, "
            "not an EC P-384 key",
        ),
        (
            expired_certificate_files,
            "tenants[0].apps[0].apns.certificate_file: The APNs certificate expired on",
        ),
        (
            lambda folder: {"key_id: ABC123DEFG": "key_id: ABC"},
            "tenants[0].apps[0].apns.key_id: Token auth needs the key id",
        ),
        (
            lambda folder: {"          topic: eu.siacs.conversations\n": ""},
            "tenants[0].apps[0].apns.topic: required",
        ),
        (
            lambda folder: {"sandbox: false": "sandbox: maybe"},
            "tenants[0].apps[0].apns.sandbox: expected true or false",
        ),
        (
            lambda folder: {"ca_file: apns-ca.pem": "cafile: apns-ca.pem"},
            "tenants[0].apps[0].apns.cafile: unknown key",
        ),
        (
            lambda folder: (folder / "apns-ca.pem").write_text("nothing here") and {},
            "tenants[0].apps[0].apns.ca_file: The trust store must hold PEM certificates",
        ),
        (
            lambda folder: {WNS_SID: "s-1-15-2-123"},
            "tenants[0].apps[0].wns.package_sid: The package SID must look like ms-app://",
        ),
        (
            lambda folder: {f"          secret: {WNS_SECRET}\n": ""},
            "tenants[0].apps[0].wns.secret: required",
        ),
        (
            lambda folder: {"https://login.live.com/accesstoken.srf": "http://login.example"},
            "tenants[0].apps[0].wns.token_url: WNS token URL must be an https URL",
        ),
        (
            lambda folder: {'"wns.example.net"': "42"},
            "tenants[0].apps[0].wns.channel_hosts: expected a list of host patterns",
        ),
        (
            lambda folder: (folder / "sa.json").write_text('{"type": "service_account"}') and {},
            "tenants[0].apps[0].fcm.service_account_file: The service account JSON lacks",
        ),
        # The admin's form refuses these too: one rule (relay.services.onboarding.valid_secret).
        (
            lambda folder: {"secret: component-secret": "secret: s3cr3t"},
            "tenants[0].components[0].secret: 16 to 255 characters",
        ),
        (
            lambda folder: {"secret: component-secret": "secret: 'has a space in it, 20+ chars'"},
            "tenants[0].components[0].secret: 16 to 255 characters",
        ),
        (
            lambda folder: {"secret: component-secret": 'secret: "component-secret\\n"'},
            "tenants[0].components[0].secret: 16 to 255 characters",
        ),
    ],
    ids=[
        "missing-key-file",
        "p384-key",
        "expired-certificate",
        "bad-key-id",
        "no-topic",
        "sandbox-not-bool",
        "unknown-key",
        "bad-ca",
        "bad-sid",
        "no-secret",
        "plain-http-token-url",
        "hosts-not-text",
        "broken-service-account",
        "short-component-secret",
        "component-secret-with-spaces",
        "component-secret-with-newline",
    ],
)
def test_errors_name_the_place_and_nothing_is_applied(files, change, message):
    replace = change(files) or {}
    with pytest.raises(ProvisioningError) as caught:
        load_tenants(document(**replace), base_dir=files)
    assert str(caught.value).startswith(message), str(caught.value)
    assert not Tenant.objects.exists()
    assert not App.objects.exists()
    assert not Component.objects.exists()


def test_the_command_reads_files_next_to_the_yaml(files, tmp_path_factory):
    path = files / "tenants.yaml"
    path.write_text(document())
    elsewhere = tmp_path_factory.mktemp("cwd")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(elsewhere)
        call_command("load_tenants", str(path), stdout=out)
    assert "1 app created" in out.getvalue()

    (files / "sa.json").write_text("{broken")
    with pytest.raises(CommandError) as caught:
        call_command("load_tenants", str(path), stdout=io.StringIO())
    assert str(caught.value).startswith(
        f"{path}: tenants[0].apps[0].fcm.service_account_file: The service account is not valid"
    )


def test_wns_secret_can_come_from_a_file(files):
    (files / "wns.secret").write_text("from-a-file\n")
    text = textwrap.dedent(
        f"""
        tenants:
          - name: example
            apps:
              - name: windows
                wns:
                  package_sid: {WNS_SID}
                  secret_file: wns.secret
        """
    )
    load_tenants(text, base_dir=files)
    wns = values(App.objects.get(name="windows"), "wns")
    assert wns["secret"] == "from-a-file"
    assert wns["channel_hosts"] == ""  # the site default applies


def test_load_tenants_and_the_admin_form_share_the_component_secret_rule(files):
    from relay.admin.components import ComponentForm
    from relay.services.onboarding import valid_secret

    for secret in ("s3cr3t", "x" * 15, "x" * 256, "with space 0123456789", "ok-" + "a" * 13):
        form = ComponentForm(data={"new_secret": secret})
        form.is_valid()
        refused_by_form = "new_secret" in form.errors
        try:
            load_tenants(
                document(**{"secret: component-secret": f"secret: '{secret}'"}), base_dir=files
            )
            refused_by_file = False
        except ProvisioningError as error:
            assert ".secret:" in str(error)
            refused_by_file = True
        assert refused_by_form == refused_by_file == (not valid_secret(secret)), secret


# --- dry runs ------------------------------------------------------------------------------------


def dry_run(path: Path) -> list[str]:
    out = io.StringIO()
    call_command("load_tenants", str(path), "--dry-run", stdout=out)
    return out.getvalue().splitlines()


def everything() -> list[tuple[object, ...]]:
    """Every stored value of every tenant, app and component, to compare before and after."""
    return [
        tuple(row.values())
        for model in (Tenant, App, ProviderCredentials, Component)
        for row in model.objects.order_by("pk").values()
    ]


# Not wrapped in a test transaction: the dry run's own transaction is the outermost one and is
# really rolled back, as when an operator runs the command.
@pytest.mark.django_db(transaction=True)
def test_a_dry_run_on_an_empty_database_lists_creations_and_keeps_nothing(files):
    path = files / "tenants.yaml"
    path.write_text(document())
    assert dry_run(path) == [
        "tenant example: created",
        "app example/conversations: created",
        "component push.example.org: created",
        f"{path}: dry run, nothing changed; would apply: "
        "1 app created, 1 component created, 1 tenant created",
    ]
    assert everything() == []


@pytest.mark.django_db(transaction=True)
def test_a_dry_run_shows_each_changed_field_with_secrets_masked_and_changes_nothing(files):
    path = files / "tenants.yaml"
    path.write_text(document())
    call_command("load_tenants", str(path), stdout=io.StringIO())
    before = everything()
    changed = document(
        **{
            WNS_SECRET: "rotated-wns-secret",
            "secret: component-secret": "secret: rotated-component-secret\n"
            "        host: xmpp.example.org\n"
            "        port: 5348",
            "display_name: Example Hosting": "display_name: Example Hosting GmbH",
            "sandbox: false": "sandbox: true",
        }
    )
    path.write_text(changed)
    lines = dry_run(path)
    assert lines == [
        "tenant example: updated (display_name: 'Example Hosting' -> 'Example Hosting GmbH')",
        "app example/conversations: updated (apns_sandbox: 'False' -> 'True'; "
        "wns_secret: ******** -> ********)",
        "component push.example.org: updated (secret: ******** -> ********; "
        "host: '127.0.0.1' -> 'xmpp.example.org'; port: '5347' -> '5348')",
        f"{path}: dry run, nothing changed; would apply: "
        "1 app updated, 1 component updated, 1 tenant updated",
    ]
    text = "\n".join(lines)
    for secret in (WNS_SECRET, "rotated-wns-secret", "component-secret", "rotated-component"):
        assert secret not in text
    assert everything() == before

    # The same document applied for real does what the dry run said.
    out = io.StringIO()
    call_command("load_tenants", str(path), stdout=out)
    assert "1 app updated, 1 component updated, 1 tenant updated" in out.getvalue()
    assert dry_run(path)[:3] == [
        "tenant example: unchanged",
        "app example/conversations: unchanged",
        "component push.example.org: unchanged",
    ]


def test_a_dry_run_refuses_a_bad_document_as_loading_does(files):
    path = files / "tenants.yaml"
    path.write_text(document(**{"secret: component-secret": "secret: short"}))
    with pytest.raises(CommandError) as caught:
        dry_run(path)
    assert "tenants[0].components[0].secret: 16 to 255 characters" in str(caught.value)
    assert everything() == []


def test_a_long_or_multiline_value_is_reported_as_changed_without_its_text(files):
    load_tenants(document(), base_dir=files)
    stored = values(App.objects.get(), "apns")["ca_certificate"]
    (files / "apns-ca.pem").write_text(CertificateAuthority.create("Another CA").pem)
    report = load_tenants(document(), base_dir=files, dry_run=True)
    [app] = [change for change in report.changes if change.kind == "app"]
    assert app.describe() == "app example/conversations: updated (apns_ca_certificate: changed)"
    assert values(App.objects.get(), "apns")["ca_certificate"] == stored
