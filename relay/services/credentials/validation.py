"""What a valid credential is, so the admin form and `load_tenants` reject the same things
with the same words. The rules are each provider's (`ProviderSpec.validate`); here they are
run and their complaints named after the form's fields (`<service>_<field>`). Errors name the
field and the problem, never the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ValidationError

from relay.crypto import UnreadableCredential
from relay.providers.registry import PROVIDERS, spec_for
from relay.providers.spec import CredentialField, ProviderSpec
from relay.services.credentials.stored import UNREADABLE


def form_name(spec: ProviderSpec, field: CredentialField) -> str:
    """The field's name in the admin form and in error messages: `<service>_<field>`."""
    return f"{spec.service}_{field.name}"


def problems(service: str, values: Mapping[str, Any]) -> dict[str, str]:
    """{field name: message} for the provider's values (field names without the prefix)."""
    spec = spec_for(service)
    found: dict[str, str] = {}
    for field in spec.fields:
        if isinstance(values.get(field.name), UnreadableCredential):
            found[field.name] = f"The stored value {UNREADABLE}."
    if found:
        return found
    return spec.validate(spec.complete(values))


def validate(service: str, values: Mapping[str, Any]) -> None:
    """Raise ValidationError({`<service>_<field>`: message}) if the values cannot work."""
    spec = spec_for(service)
    found = problems(service, values)
    if found:
        raise ValidationError(
            {form_name(spec, spec.field_named(name)): [message] for name, message in found.items()}
        )


def validate_credentials(*, values: Mapping[str, Any]) -> None:
    """Every provider's fields at once, keyed by form name; one ValidationError naming each
    bad field."""
    by_field: dict[str, list[str]] = {}
    for spec in PROVIDERS:
        own = {
            field.name: values[form_name(spec, field)]
            for field in spec.fields
            if form_name(spec, field) in values
        }
        try:
            validate(spec.service, own)
        except ValidationError as error:
            for name, messages in error.message_dict.items():
                by_field.setdefault(name, []).extend(messages)
    if by_field:
        raise ValidationError(by_field)
