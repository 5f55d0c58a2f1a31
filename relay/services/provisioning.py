"""Provisioning as code: tenants, apps and components from a YAML document, idempotently.

Operators keep their setup in version control and apply it with `manage.py load_tenants`;
applying the same file twice changes nothing. The whole file applies, or nothing does. A dry
run applies it inside a transaction that is then rolled back: the same code and the same
checks decide what it reports, and nothing is kept.

An app's provider sections (one per provider, named like it: `fcm`, `apns`, `wns`, ...) hold
its credentials, the fields its spec declares (relay/providers/<name>/spec.py); files are read
relative to the YAML's folder and validated by `relay.services.credentials`, exactly as the
admin form does. A section that is left out keeps what is stored; a section that is given
replaces that provider's settings as a whole (so switching APNs from key to certificate auth
removes the key).

A component serves the p2 commands (`app`), what feature apps add (each its own section,
`relay.features.ComponentPart`: UnifiedPush's is `unifiedpush: {endpoint_url,
token_lifetime_days}`), or both; a component document describes it whole, so leaving out a
feature's section turns that feature off for it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from django.db import transaction
from slixmpp.jid import JID, InvalidJID

from relay import features
from relay.crypto import CredentialKeyError
from relay.models import App, Component, Tenant
from relay.providers.registry import PROVIDERS, spec_for
from relay.providers.spec import CredentialField, ProviderSpec
from relay.services import onboarding
from relay.services.credentials import records
from relay.services.credentials import validation as credential_validation


class ProvisioningError(ValueError):
    """The document is wrong; the message names the place (e.g. tenants[0].apps[1].fcm)."""


MASK = "********"


@dataclass(frozen=True)
class FieldChange:
    """One field of an updated object; secrets never carry their values."""

    name: str
    old: str
    new: str
    secret: bool

    def describe(self) -> str:
        if self.secret:
            return f"{self.name}: {MASK} -> {MASK}"
        if "\n" in self.old + self.new or len(self.old + self.new) > 120:
            return f"{self.name}: changed"  # a PEM or a list: its value helps nobody here
        return f"{self.name}: {self.old!r} -> {self.new!r}"


@dataclass(frozen=True)
class ObjectChange:
    """What applying the document did (or would do) to one tenant, app or component."""

    kind: str
    label: str
    change: str  # created, updated, unchanged or removed
    fields: tuple[FieldChange, ...] = ()

    def describe(self) -> str:
        details = f" ({'; '.join(f.describe() for f in self.fields)})" if self.fields else ""
        return f"{self.kind} {self.label}: {self.change}{details}"


@dataclass
class ProvisioningReport:
    counts: Counter[str] = field(default_factory=Counter)
    changes: list[ObjectChange] = field(default_factory=list)
    dry_run: bool = False

    def note(self, change: ObjectChange) -> None:
        self.counts[f"{change.kind} {change.change}"] += 1
        self.changes.append(change)

    def summary(self) -> str:
        return (
            ", ".join(f"{count} {what}" for what, count in sorted(self.counts.items())) or "nothing"
        )


def _is_secret(model: type[Any], name: str) -> bool:
    """Component secrets are never shown (credentials: their spec says which are secret)."""
    return name == "secret"


def _shown(value: Any) -> str:
    return "" if value is None else str(value)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProvisioningError(f"{where}: expected a mapping")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProvisioningError(f"{where}: expected a list")
    return value


def _text(mapping: dict[str, Any], key: str, where: str, *, required: bool = True) -> str:
    value = mapping.get(key)
    if value is None or value == "":
        if required:
            raise ProvisioningError(f"{where}.{key}: required")
        return ""
    if not isinstance(value, str | int):
        raise ProvisioningError(f"{where}.{key}: expected text")
    return str(value)


def _read_file(path_text: str, where: str, base_dir: Path) -> str:
    path = Path(path_text)
    if not path.is_absolute():
        path = base_dir / path
    try:
        return path.read_text()
    except OSError as error:
        raise ProvisioningError(f"{where}: cannot read {path_text}: {error.strerror}") from error


def _known_keys(section: dict[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(str(key) for key in section if key not in known)
    if unknown:
        raise ProvisioningError(f"{where}.{unknown[0]}: unknown key")


def _optional_file(section: dict[str, Any], key: str, where: str, base_dir: Path) -> str:
    path = _text(section, key, where, required=False)
    return _read_file(path, f"{where}.{key}", base_dir).strip() if path else ""


def _yaml_key(field: CredentialField, section: dict[str, Any]) -> str:
    """Where the field is (or belongs) in the section, for error messages."""
    name = field.yaml_name
    if field.from_file and (f"{name}_file" in section or (field.upload and name not in section)):
        return f"{name}_file"
    return name


def _field_value(field: CredentialField, section: dict[str, Any], here: str, base_dir: Path) -> Any:
    name = field.yaml_name
    if field.from_file and f"{name}_file" in section:
        if name in section:
            raise ProvisioningError(f"{here}.{name}_file: give {name} or {name}_file, not both")
        return _optional_file(section, f"{name}_file", here, base_dir)
    if field.kind == "bool":
        value = section.get(name, False)
        if not isinstance(value, bool):
            raise ProvisioningError(f"{here}.{name}: expected true or false")
        return value
    if field.kind == "lines":
        items = section.get(name) or []
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ProvisioningError(f"{here}.{name}: expected a list of host patterns")
        return "\n".join(item.strip() for item in items)
    return _text(section, name, here, required=False)


def _provider_values(spec: ProviderSpec, section: Any, here: str, base_dir: Path) -> dict[str, Any]:
    """A provider's section: its spec's fields (a secret or PEM also as `<name>_file`, read
    relative to the YAML), checked as the admin checks them."""
    section = _mapping(section, here)
    known = {field.yaml_name for field in spec.fields}
    known |= {f"{field.yaml_name}_file" for field in spec.fields if field.from_file}
    _known_keys(section, frozenset(known), here)
    values = {item.name: _field_value(item, section, here, base_dir) for item in spec.fields}
    for item in spec.fields:
        if item.required and values[item.name] in ("", None):
            raise ProvisioningError(f"{here}.{_yaml_key(item, section)}: required")
    if not spec.configured(values):
        raise ProvisioningError(f"{here}: no credentials given")
    found = credential_validation.problems(spec.service, values)
    if found:
        name, message = next(iter(found.items()))
        raise ProvisioningError(f"{here}.{_yaml_key(spec.field_named(name), section)}: {message}")
    return spec.complete(values)


def _app_credentials(app_doc: dict[str, Any], where: str, base_dir: Path) -> dict[str, Any]:
    """The provider sections given, by service; a section left out keeps what is stored."""
    return {
        spec.service: _provider_values(
            spec, app_doc[spec.service], f"{where}.{spec.service}", base_dir
        )
        for spec in PROVIDERS
        if app_doc.get(spec.service) is not None
    }


def _upsert_app(
    tenant: Tenant,
    name: str,
    credentials: dict[str, dict[str, Any]],
    report: ProvisioningReport,
) -> App:
    """The app and the credentials records its sections give (each replaced as a whole)."""
    label = f"{tenant.name}/{name}"
    app = App.objects.filter(tenant=tenant, name=name).first()
    created = app is None
    if app is None:
        app = App.objects.create(tenant=tenant, name=name)
    changes: list[FieldChange] = []
    for service, new in credentials.items():
        spec = spec_for(service)
        try:
            old = records.values_of(app, service)
        except CredentialKeyError:
            old = {field.name: None for field in spec.fields}  # unreadable: all replaced
        changes.extend(
            FieldChange(
                credential_validation.form_name(spec, field),
                _shown(old[field.name]),
                _shown(new[field.name]),
                field.secret,
            )
            for field in spec.fields
            if old[field.name] != new[field.name]
        )
        records.store(app, service, new)
    kind = str(App._meta.verbose_name)
    if created:
        report.note(ObjectChange(kind, label, "created"))
    else:
        report.note(
            ObjectChange(kind, label, "updated" if changes else "unchanged", tuple(changes))
        )
    return app


def _upsert(
    model: type[Any],
    report: ProvisioningReport,
    label: str,
    lookup: dict[str, Any],
    values: dict[str, Any],
) -> Any:
    obj = model.objects.filter(**lookup).first()
    kind = model._meta.verbose_name
    if obj is None:
        obj = model.objects.create(**lookup, **values)
        report.note(ObjectChange(kind, label, "created"))
        return obj
    changed = [name for name, value in values.items() if getattr(obj, name) != value]
    fields = tuple(
        FieldChange(
            name,
            _shown(getattr(obj, name)),
            _shown(values[name]),
            _is_secret(model, name),
        )
        for name in changed
    )
    if changed:
        for name in changed:
            setattr(obj, name, values[name])
        obj.save()
        report.note(ObjectChange(kind, label, "updated", fields))
    else:
        report.note(ObjectChange(kind, label, "unchanged"))
    return obj


def load_tenants(document: str, *, base_dir: Path, dry_run: bool = False) -> ProvisioningReport:
    """Apply the document; with `dry_run`, report what it would change and keep nothing."""
    try:
        data = yaml.safe_load(document)
    except yaml.YAMLError as error:
        raise ProvisioningError(f"not valid YAML: {error}") from error
    data = _mapping(data, "document")
    report = ProvisioningReport(dry_run=dry_run)
    with transaction.atomic():
        _apply(data, base_dir, report)
        if dry_run:
            transaction.set_rollback(True)
    return report


def _apply(data: dict[str, Any], base_dir: Path, report: ProvisioningReport) -> None:
    for t_index, tenant_doc in enumerate(_list(data.get("tenants"), "tenants")):
        where = f"tenants[{t_index}]"
        tenant_doc = _mapping(tenant_doc, where)
        tenant_name = _text(tenant_doc, "name", where)
        tenant = _upsert(
            Tenant,
            report,
            tenant_name,
            {"name": tenant_name},
            {"display_name": _text(tenant_doc, "display_name", where, required=False)},
        )
        apps: dict[str, App] = {}
        for a_index, app_doc in enumerate(_list(tenant_doc.get("apps"), f"{where}.apps")):
            app_where = f"{where}.apps[{a_index}]"
            app_doc = _mapping(app_doc, app_where)
            name = _text(app_doc, "name", app_where)
            apps[name] = _upsert_app(
                tenant, name, _app_credentials(app_doc, app_where, base_dir), report
            )
        for c_index, comp_doc in enumerate(
            _list(tenant_doc.get("components"), f"{where}.components")
        ):
            comp_where = f"{where}.components[{c_index}]"
            _component(tenant, apps, _mapping(comp_doc, comp_where), comp_where, report)


def _component(
    tenant: Tenant,
    apps: dict[str, App],
    doc: dict[str, Any],
    where: str,
    report: ProvisioningReport,
) -> None:
    jid_text = _text(doc, "jid", where)
    try:
        jid = JID(jid_text)
    except InvalidJID as error:
        raise ProvisioningError(f"{where}.jid: not a valid JID") from error
    if jid.user or jid.resource:
        raise ProvisioningError(f"{where}.jid: a component JID is a bare domain")
    app_name = _text(doc, "app", where, required=False)
    app = None
    if app_name:
        app = apps.get(app_name) or App.objects.filter(tenant=tenant, name=app_name).first()
        if app is None:
            raise ProvisioningError(f"{where}.app: no app {app_name!r} in this tenant")
    parts = _feature_parts(doc, where)
    if app is None and not any(values is not None for _, values in parts):
        served = ", ".join(part.key for part, _ in parts)
        raise ProvisioningError(f"{where}: give app (p2 commands), {served}, or both")
    try:
        port = int(doc.get("port", 5347))
    except (TypeError, ValueError) as error:
        raise ProvisioningError(f"{where}.port: expected a number") from error
    if not 0 < port < 65536:
        raise ProvisioningError(f"{where}.port: out of range")
    existing = Component.objects.filter(jid=str(jid)).first()
    if existing is not None and existing.tenant_id != tenant.pk:
        raise ProvisioningError(f"{where}.jid: belongs to another tenant")
    enabled = doc.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ProvisioningError(f"{where}.enabled: expected true or false")
    secret = _text(doc, "secret", where)
    if not onboarding.valid_secret(secret):
        # The admin's form applies the same rule (onboarding.SECRET_PATTERN).
        raise ProvisioningError(f"{where}.secret: {onboarding.SECRET_HELP}")
    component = _upsert(
        Component,
        report,
        str(jid),
        {"jid": str(jid)},
        {
            "tenant": tenant,
            "app": app,
            "secret": secret,
            "host": _text(doc, "host", where, required=False) or "127.0.0.1",
            "port": port,
            "enabled": enabled,
        },
    )
    for part, values in parts:
        label = str(jid)
        if values is not None:
            _upsert(part.model, report, label, {"component": component}, values)
        elif part.model._default_manager.filter(component=component).delete()[0]:
            report.note(ObjectChange(str(part.model._meta.verbose_name), label, "removed"))


def _feature_parts(
    doc: dict[str, Any], where: str
) -> list[tuple[features.ComponentPart, dict[str, Any] | None]]:
    """Each feature app's settings of the component from its section (relay.features); None
    for a section left out: the component does not serve that feature."""
    parts: list[tuple[features.ComponentPart, dict[str, Any] | None]] = []
    for part in features.component_parts():
        section = doc.get(part.key)
        if section is None:
            parts.append((part, None))
            continue
        try:
            parts.append((part, part.provisioned(section, f"{where}.{part.key}")))
        except ValueError as error:
            raise ProvisioningError(str(error)) from None
    return parts
