"""Provider credentials move from App's per-provider columns into one encrypted record per app
and provider (ProviderCredentials).

The values are read through the historical model, so each decrypts with whichever configured
CREDENTIAL_KEYS entry encrypted it (rotated keys included) and is written again under the
current key. A value no configured key decrypts cannot be carried over: the migration stops
and names the app, and nothing is changed (add the old key back to CREDENTIAL_KEYS, or clear
the value in the admin, then migrate again).
"""

import json

import django.db.models.deletion
from django.db import migrations, models

import relay.crypto

# The record's fields per provider and the columns they came from, as they were.
COLUMNS = {
    "fcm": {"service_account": "fcm_service_account", "endpoint": "fcm_endpoint"},
    "apns": {
        "topic": "apns_topic",
        "sandbox": "apns_sandbox",
        "key": "apns_key",
        "key_id": "apns_key_id",
        "team_id": "apns_team_id",
        "certificate": "apns_certificate",
        "private_key": "apns_private_key",
        "endpoint": "apns_endpoint",
        "ca_certificate": "apns_ca_certificate",
    },
    "wns": {
        "package_sid": "wns_package_sid",
        "secret": "wns_secret",
        "token_url": "wns_token_url",
        "channel_hosts": "wns_channel_hosts",
    },
}


def _set(value):
    return bool(value) if isinstance(value, bool) else bool((value or "").strip())


def forwards(apps, schema_editor):
    App = apps.get_model("relay", "App")
    ProviderCredentials = apps.get_model("relay", "ProviderCredentials")
    for app in App.objects.order_by("pk").iterator():
        for service, columns in COLUMNS.items():
            values = {name: getattr(app, column) for name, column in columns.items()}
            for name, value in values.items():
                if isinstance(value, relay.crypto.UnreadableCredential):
                    raise RuntimeError(
                        f"App {app.pk}: the stored {columns[name]} cannot be decrypted with the "
                        "configured CREDENTIAL_KEYS; add its key back (or clear it in the admin) "
                        "and migrate again."
                    )
            if not any(_set(value) for value in values.values()):
                continue
            values = {
                name: value if isinstance(value, bool) else (value or "")
                for name, value in values.items()
            }
            ProviderCredentials.objects.create(
                app=app,
                service=service,
                values=json.dumps(values, sort_keys=True),
                not_after=app.apns_certificate_not_after if service == "apns" else None,
            )


def backwards(apps, schema_editor):
    App = apps.get_model("relay", "App")
    ProviderCredentials = apps.get_model("relay", "ProviderCredentials")
    for record in ProviderCredentials.objects.order_by("pk").iterator():
        if isinstance(record.values, relay.crypto.UnreadableCredential):
            raise RuntimeError(
                f"App {record.app_id}: its {record.service} credentials cannot be decrypted with "
                "the configured CREDENTIAL_KEYS."
            )
        columns = COLUMNS.get(record.service)
        if columns is None:
            continue  # a provider that had no columns keeps nothing when going back
        values = json.loads(record.values)
        update = {column: values.get(name, "") for name, column in columns.items()}
        if record.service == "apns":
            update["apns_certificate_not_after"] = record.not_after
        app = App.objects.get(pk=record.app_id)
        for column, value in update.items():
            setattr(app, column, value)
        app.save(update_fields=list(update))


class Migration(migrations.Migration):

    dependencies = [
        ("relay", "0016_unifiedpush_settings_leave_the_component"),
    ]

    operations = [
        migrations.CreateModel(
            name="ProviderCredentials",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("service", models.CharField(choices=[("fcm", "Firebase Cloud Messaging"), ("apns", "Apple Push Notification service"), ("wns", "Windows Push Notification Services")], max_length=8)),
                ("values", relay.crypto.EncryptedTextField(help_text="The provider's fields as a JSON object.")),
                ("not_after", models.DateTimeField(blank=True, help_text="When a credential in it expires (a certificate).", null=True)),
                ("updated", models.DateTimeField(auto_now=True)),
                ("app", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="credentials", to="relay.app")),
            ],
            options={
                "verbose_name_plural": "provider credentials",
                "indexes": [models.Index(fields=["not_after"], name="relay_provi_not_aft_03e680_idx")],
                "constraints": [models.UniqueConstraint(fields=("app", "service"), name="providercredentials_unique_service_per_app")],
            },
        ),
        migrations.RunPython(forwards, backwards),
        *(
            migrations.RemoveField(model_name="app", name=column)
            for columns in COLUMNS.values()
            for column in columns.values()
        ),
        migrations.RemoveField(model_name="app", name="apns_certificate_not_after"),
    ]
