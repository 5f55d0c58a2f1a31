"""What a push provider brings to the relay, declared once in its own package (`SPEC`).

The core never names a provider: the admin builds its form fields from `fields`, provisioning
reads a YAML section named `service` with the same fields, the credentials service validates
with `validate` and the registry builds the client with `build`; the registration commands
`register-push-<service>` read `registration`'s form fields. `relay.providers.registry.PROVIDERS`
is the one table listing the specs.

Django-free like every provider: fields are described here as data, and the admin turns them
into Django form fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from relay.providers.base import PushProvider

# text: one line; url: an http(s) URL; bool: a switch; lines: one value per line (a list in
# YAML); textarea: several lines of plain text (a PEM trust store); secret: a one-line secret;
# secret_text: a secret of several lines (a key, a JSON document). Secrets are write-only.
FieldKind = Literal["text", "url", "bool", "lines", "textarea", "secret", "secret_text"]
Values = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class CredentialField:
    """One setting of a provider's credentials record (and of its admin form and YAML)."""

    name: str
    label: str
    kind: FieldKind = "text"
    help: str = ""
    # Files the admin's upload may be (its `accept`); "" for a field typed in only.
    upload: str = ""
    # The field's name in YAML when it is not `name` (a file: `<yaml>_file`).
    yaml: str = ""
    # Required whenever the provider's section is given in YAML (the spec's `validate`
    # says so in the admin, with the rest of what makes the values whole).
    required: bool = False

    @property
    def secret(self) -> bool:
        return self.kind in ("secret", "secret_text")

    @property
    def from_file(self) -> bool:
        """In YAML, `<name>_file` may give it (secrets, uploads, PEM texts), besides `<name>`
        inline."""
        return self.secret or bool(self.upload) or self.kind == "textarea"

    @property
    def yaml_name(self) -> str:
        return self.yaml or self.name

    def empty(self) -> bool | str:
        return False if self.kind == "bool" else ""


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a provider's client is built with besides its credentials."""

    timeout: float
    # The app's payload shape for this provider, as `ProviderSpec.payload` read it.
    payload: Any
    # A site setting by its name in relay.environment (defaults some providers fall back to).
    setting: Callable[[str], Any]
    # Where a provider may keep files (a trust store aioapns wants as a path).
    var_dir: Path


def _token_field(fields: Mapping[str, str]) -> str:
    token = (fields.get("token") or "").strip()
    if not token:
        raise ValueError("token is required")
    return token


def _no_expiry(values: Values) -> datetime | None:
    return None


def _no_summary(values: Values) -> list[tuple[str, str]]:
    return []


def _no_payload(options: Any) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Registration:
    """The registration command's form: which fields it has and the token they make.

    `token` turns the submitted fields into the registration's provider address, or raises
    ValueError with a message for the phone (docs/protocols.md documents the fields).
    """

    fields: tuple[str, ...] = ("token",)
    token: Callable[[Mapping[str, str]], str] = _token_field


@dataclass(frozen=True)
class ProviderSpec:
    """A push provider as the relay plugs it in."""

    # The short name: Registration.service, Delivery.provider, `register-push-<service>`, the
    # YAML section, metrics' label. At most 8 characters (the columns).
    service: str
    label: str
    # Error codes' prefix when the app cannot send through it (`<code>_NOT_CONFIGURED`).
    code: str
    fields: tuple[CredentialField, ...]
    # Whether the values configure the provider at all (else: not configured, no error).
    configured: Callable[[Values], bool]
    # {field name: message} for every field that cannot work; messages never echo a secret.
    validate: Callable[[Values], dict[str, str]]
    # The client for an app's validated values; raises ValueError when they cannot work.
    build: Callable[[Values, BuildContext], PushProvider]
    description: str = ""
    # When the credentials stop working (an APNs certificate's end), for warnings and alerts.
    expiry: Callable[[Values], datetime | None] = _no_expiry
    # What the admin may show of them besides fingerprints of the secrets (a project id).
    summary: Callable[[Values], list[tuple[str, str]]] = _no_summary
    registration: Registration = field(default_factory=Registration)
    # Why a registration's token can never be sent to with these values ("" if it can):
    # checked at registration, so a refused address is not dead-lettered at every push.
    refuse_token: Callable[[Values, str, Callable[[str], Any]], str] | None = None
    # The app's payload shape for this provider from its payload options (ValueError if bad).
    payload: Callable[[Any], Any] = _no_payload
    # New values for the admin's "generate" switch (a key pair the provider can make itself).
    generate: Callable[[], dict[str, str]] | None = None

    def field_named(self, name: str) -> CredentialField:
        for credential_field in self.fields:
            if credential_field.name == name:
                return credential_field
        raise KeyError(name)

    def complete(self, values: Values) -> dict[str, Any]:
        """Every field, the missing ones empty: what `validate` and `build` are given."""
        return {f.name: values.get(f.name, f.empty()) for f in self.fields}
