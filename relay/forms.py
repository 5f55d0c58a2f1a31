"""The admin's app form: provider credentials are write-only and validated before they are saved.

A stored secret is never rendered back: its input is always empty, and the help text shows a
fingerprint instead. An empty input keeps the stored value, the "clear" box removes it, and a
file can be uploaded instead of pasting. What makes a credential valid is decided by
`relay.services.credentials`, the same rules `load_tenants` applies.
"""

from __future__ import annotations

from typing import Any, cast

from django import forms
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import UploadedFile
from django.db import models

from relay.models import App
from relay.services.credentials.stored import credential_fingerprint
from relay.services.credentials.validation import refresh_derived_fields, validate_credentials

MAX_UPLOAD_BYTES = 64 * 1024

# The encrypted credentials: write-only in this form.
SECRET_FIELDS = (
    "fcm_service_account",
    "apns_key",
    "apns_certificate",
    "apns_private_key",
    "wns_secret",
)
PROVIDER_PREFIXES = ("fcm_", "apns_", "wns_")
# The syntax of relay.providers.wns.parse_host_pattern (docs/windows-api.md).
WNS_CHANNEL_HOSTS_HELP = (
    "Where this app's channel URIs may point, one pattern per line; empty: the site default "
    "(*.notify.windows.com). '*.example.com' allows its subdomains on port 443; a bare host "
    "('wns.example.net', '127.0.0.1') allows the default port only (443, or 80 for http); "
    "'host:8443' one port, 'host:*' any port. Plain http only for loopback hosts. A device "
    "registering a channel outside these is refused."
)


class WriteOnlyTextarea(forms.Textarea):
    """A textarea that never renders a value: neither the stored secret nor a re-posted one."""

    def format_value(self, value: Any) -> None:
        return None


class HttpsURLField(forms.URLField):
    """A URL without a scheme means https (Django 6's default, without the warning now)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("assume_scheme", "https")
        super().__init__(**kwargs)


class SecretField(forms.CharField):
    """A write-only credential input: counts as changed only when something was entered."""

    def has_changed(self, initial: Any, data: Any) -> bool:
        return bool(data)


def _secret(label: str, *, multiline: bool = True) -> SecretField:
    attrs = {"autocomplete": "off", "spellcheck": "false"}
    widget: forms.Widget = (
        WriteOnlyTextarea(attrs={**attrs, "rows": 4})
        if multiline
        else forms.PasswordInput(render_value=False, attrs=attrs)
    )
    return SecretField(label=label, required=False, widget=widget)


def _upload(label: str, accept: str) -> forms.FileField:
    return forms.FileField(
        label=label, required=False, widget=forms.FileInput(attrs={"accept": accept})
    )


def _clear(what: str) -> forms.BooleanField:
    return forms.BooleanField(label=f"Remove the stored {what}", required=False)


class AppForm(forms.ModelForm):
    fcm_service_account = _secret("Service account JSON")
    fcm_service_account_file = _upload("… or upload it", ".json,application/json")
    fcm_service_account_clear = _clear("service account")
    apns_key = _secret(".p8 key (token auth)")
    apns_key_file = _upload("… or upload it", ".p8,.pem")
    apns_key_clear = _clear("key")
    apns_certificate = _secret("Certificate, PEM (certificate auth)")
    apns_certificate_file = _upload("… or upload it", ".pem,.crt,.cer")
    apns_certificate_clear = _clear("certificate")
    apns_private_key = _secret("Certificate's private key, PEM")
    apns_private_key_file = _upload("… or upload it", ".pem,.key")
    apns_private_key_clear = _clear("private key")
    wns_secret = _secret("Client secret", multiline=False)
    wns_secret_clear = _clear("client secret")

    class Meta:
        model = App
        fields = "__all__"
        field_classes = {"fcm_endpoint": HttpsURLField, "wns_token_url": HttpsURLField}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "wns_channel_hosts" in self.fields:
            self.fields["wns_channel_hosts"].help_text = WNS_CHANNEL_HOSTS_HELP
        for name in SECRET_FIELDS:
            stored = credential_fingerprint(getattr(self.instance, name))
            base = cast("models.Field[Any, Any]", App._meta.get_field(name)).help_text
            note = f"Stored: {stored}. Leave empty to keep it."
            self.fields[name].help_text = f"{base} {note}" if base else note

    def clean_payload_options(self) -> Any:
        # An emptied JSON box means "the defaults", not SQL NULL in a NOT NULL column.
        value = self.cleaned_data.get("payload_options")
        return {} if value is None else value

    def _upload_text(self, name: str) -> str:
        upload: UploadedFile | None = self.cleaned_data.get(f"{name}_file")
        if not upload:
            return ""
        if upload.size is not None and upload.size > MAX_UPLOAD_BYTES:
            raise ValidationError({f"{name}_file": "The file is too large for a credential."})
        try:
            return upload.read(MAX_UPLOAD_BYTES + 1).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValidationError(
                {f"{name}_file": "The file is not text (PEM or JSON expected)."}
            ) from None

    def _resolve(self, name: str) -> str:
        """What the field will hold: cleared, uploaded, pasted, or else the stored value."""
        pasted = self.cleaned_data.get(name) or ""
        uploaded = self._upload_text(name) if f"{name}_file" in self.fields else ""
        if self.cleaned_data.get(f"{name}_clear"):
            if pasted or uploaded:
                raise ValidationError({name: "Either remove the stored value or enter a new one."})
            return ""
        if pasted and uploaded:
            raise ValidationError({name: "Either paste the value or upload a file, not both."})
        return pasted or uploaded or (getattr(self.instance, name) or "")

    def clean(self) -> dict[str, Any]:
        cleaned = cast(dict[str, Any], super().clean())  # a ModelForm's is never None
        resolved = True
        for name in SECRET_FIELDS:
            try:
                cleaned[name] = self._resolve(name)
            except ValidationError as error:
                self.add_error(None, error)
                resolved = False
        if not resolved:
            return cleaned
        values = {
            field.name: cleaned[field.name]
            if field.name in cleaned
            else field.value_from_object(self.instance)
            for field in App._meta.concrete_fields
            if field.name.startswith(PROVIDER_PREFIXES)
        }
        try:
            validate_credentials(values=values)
        except ValidationError as error:
            for field, messages in error.message_dict.items():
                if field in self.errors:
                    continue  # the field's own error says more
                for message in messages:
                    self.add_error(field if field in self.fields else None, message)
        return cleaned

    def save(self, commit: bool = True) -> App:
        app = super().save(commit=False)
        refresh_derived_fields(app=app)
        if commit:
            app.save()
            self.save_m2m()  # set by save(commit=False): Django's _save_m2m
        return app


def _secret_rows(name: str) -> tuple[str | tuple[str, ...], ...]:
    if name == "wns_secret":
        return (name, f"{name}_clear")
    return (name, (f"{name}_file", f"{name}_clear"))


APP_FIELDSETS: list[tuple[str | None, dict[str, Any]]] = [
    (None, {"fields": ("tenant", "name", "public_key")}),
    (
        "Firebase Cloud Messaging",
        {"fields": (*_secret_rows("fcm_service_account"), "fcm_endpoint")},
    ),
    (
        "Apple Push Notification service",
        {
            "fields": (
                ("apns_topic", "apns_sandbox"),
                *_secret_rows("apns_key"),
                ("apns_key_id", "apns_team_id"),
                *_secret_rows("apns_certificate"),
                *_secret_rows("apns_private_key"),
                "apns_endpoint",
                "apns_ca_certificate",
            ),
            "description": "Token auth (a .p8 key with key id and team id) or certificate "
            "auth (a certificate and its private key), not both.",
        },
    ),
    (
        "Windows Push Notification Services",
        {
            "fields": (
                "wns_package_sid",
                *_secret_rows("wns_secret"),
                "wns_token_url",
                "wns_channel_hosts",
            )
        },
    ),
    ("Payload", {"fields": ("payload_options",), "classes": ("collapse",)}),
]
