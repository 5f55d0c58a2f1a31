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
from django.forms.models import ModelFormMetaclass

from relay.crypto import CredentialKeyError
from relay.models import App
from relay.providers.registry import PROVIDERS
from relay.providers.spec import CredentialField, ProviderSpec
from relay.services.credentials import records
from relay.services.credentials.stored import credential_fingerprint
from relay.services.credentials.validation import form_name, problems

MAX_UPLOAD_BYTES = 64 * 1024


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


def _credential_field(field: CredentialField) -> forms.Field:
    """The Django form field for a provider's declared field (relay/providers/spec.py)."""
    if field.secret:
        return _secret(field.label, multiline=field.kind == "secret_text")
    if field.kind == "bool":
        return forms.BooleanField(label=field.label, required=False, help_text=field.help)
    if field.kind == "url":
        return HttpsURLField(label=field.label, required=False, help_text=field.help)
    if field.kind in ("lines", "textarea"):
        return forms.CharField(
            label=field.label,
            required=False,
            help_text=field.help,
            widget=forms.Textarea(attrs={"rows": 3}),
        )
    return forms.CharField(label=field.label, required=False, max_length=255, help_text=field.help)


def _declared_fields() -> dict[str, forms.Field]:
    """Every provider's fields, named `<service>_<field>`, with a secret's upload and clear."""
    declared: dict[str, forms.Field] = {}
    for spec in PROVIDERS:
        for field in spec.fields:
            name = form_name(spec, field)
            declared[name] = _credential_field(field)
            if field.secret and field.upload:
                declared[f"{name}_file"] = _upload("… or upload it", field.upload)
            if field.secret:
                what = field.label.split(",")[0].split(" (")[0].lower()
                declared[f"{name}_clear"] = _clear(what)
        if spec.generate is not None:
            declared[f"{spec.service}_generate"] = forms.BooleanField(
                label="Generate new keys", required=False
            )
    return declared


class _AppForm(forms.ModelForm):
    """The app's own fields, and every provider's declared fields (added by `AppForm`)."""

    class Meta:
        model = App
        fields = "__all__"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.credentials: dict[str, dict[str, Any]] = {}
        self.stored: dict[str, dict[str, Any]] = {}
        for spec in PROVIDERS:
            self.stored[spec.service] = self._stored(spec)
            for field in spec.fields:
                name = form_name(spec, field)
                if name not in self.fields:
                    continue
                value = self.stored[spec.service][field.name]
                if field.secret:
                    note = f"Stored: {credential_fingerprint(value)}. Leave empty to keep it."
                    self.fields[name].help_text = f"{field.help} {note}" if field.help else note
                elif value or field.kind == "bool":
                    self.initial.setdefault(name, value)

    def _stored(self, spec: ProviderSpec) -> dict[str, Any]:
        """The stored values; secrets of a record no key decrypts are marked unreadable."""
        if self.instance.pk is None:
            return spec.complete({})
        try:
            return records.values_of(self.instance, spec.service)
        except CredentialKeyError:
            marker = records.unreadable_marker()
            return {f.name: marker if f.secret else f.empty() for f in spec.fields}

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

    def _resolve(self, name: str, stored: Any) -> Any:
        """What a secret will hold: cleared, uploaded, pasted, or else the stored value."""
        pasted = self.cleaned_data.get(name) or ""
        uploaded = self._upload_text(name) if f"{name}_file" in self.fields else ""
        if self.cleaned_data.get(f"{name}_clear"):
            if pasted or uploaded:
                raise ValidationError({name: "Either remove the stored value or enter a new one."})
            return ""
        if pasted and uploaded:
            raise ValidationError({name: "Either paste the value or upload a file, not both."})
        return pasted or uploaded or stored

    def _touched(self, spec: ProviderSpec) -> bool:
        prefix = f"{spec.service}_"
        return any(name.startswith(prefix) for name in self.changed_data)

    def clean(self) -> dict[str, Any]:
        cleaned = cast(dict[str, Any], super().clean())  # a ModelForm's is never None
        for spec in PROVIDERS:
            if not self._touched(spec):
                continue  # left alone: the stored record stays as it is
            self._clean_provider(spec, cleaned)
        return cleaned

    def _clean_provider(self, spec: ProviderSpec, cleaned: dict[str, Any]) -> None:
        stored = self.stored[spec.service]
        values: dict[str, Any] = {}
        for field in spec.fields:
            name = form_name(spec, field)
            if field.secret:
                try:
                    values[field.name] = self._resolve(name, stored[field.name])
                except ValidationError as error:
                    self.add_error(None, error)
                    return
            else:
                value = cleaned.get(name)
                values[field.name] = field.empty() if value is None else value
        if spec.generate is not None and cleaned.get(f"{spec.service}_generate"):
            values.update(spec.generate())
        found = problems(spec.service, values)
        for field_name, message in found.items():
            name = form_name(spec, spec.field_named(field_name))
            if name in self.errors:
                continue  # the field's own error says more
            self.add_error(name if name in self.fields else None, message)
        if not found:
            self.credentials[spec.service] = values

    def _save_m2m(self) -> None:
        """After the app is saved (the admin calls it through save_m2m): its credentials."""
        super()._save_m2m()  # type: ignore[misc]
        app: App = self.instance
        records.forget(app)
        for service, values in self.credentials.items():
            records.store(app, service, values)


# The admin's app form: the model's fields and every provider's (a new provider's fields
# appear with its spec).
AppForm = cast(
    "type[_AppForm]",
    ModelFormMetaclass("AppForm", (_AppForm,), {"__module__": __name__, **_declared_fields()}),
)


def _secret_rows(spec: ProviderSpec, field: CredentialField) -> tuple[str | tuple[str, ...], ...]:
    name = form_name(spec, field)
    if not field.upload:
        return (name, f"{name}_clear")
    return (name, (f"{name}_file", f"{name}_clear"))


def _provider_fieldset(spec: ProviderSpec) -> tuple[str, dict[str, Any]]:
    rows: list[str | tuple[str, ...]] = []
    for field in spec.fields:
        if field.secret:
            rows.extend(_secret_rows(spec, field))
        else:
            rows.append(form_name(spec, field))
    if spec.generate is not None:
        rows.append(f"{spec.service}_generate")
    options: dict[str, Any] = {"fields": tuple(rows)}
    if spec.description:
        options["description"] = spec.description
    return spec.label, options


APP_FIELDSETS: list[tuple[str | None, dict[str, Any]]] = [
    (None, {"fields": ("tenant", "name", "public_key")}),
    *(_provider_fieldset(spec) for spec in PROVIDERS),
    ("Payload", {"fields": ("payload_options",), "classes": ("collapse",)}),
]
