"""Provisioning as code: tenants, apps and components from a YAML document, idempotently.

Operators keep their setup in version control and apply it with `manage.py load_tenants`;
applying the same file twice changes nothing. The whole file applies, or nothing does. A dry
run applies it inside a transaction that is then rolled back: the same code and the same
checks decide what it reports, and nothing is kept.

An app's `fcm`, `apns` and `wns` sections hold its provider credentials; files are read
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from django.core.exceptions import ValidationError
from django.db import transaction
from slixmpp.jid import JID, InvalidJID

from relay import features
from relay.crypto import EncryptedTextField
from relay.models import App, Component, Tenant
from relay.services import onboarding
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
    """Credentials (encrypted at rest) and component secrets are never shown."""
    return name == "secret" or isinstance(model._meta.get_field(name), EncryptedTextField)


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


# Model field -> where it comes from in an app's YAML, for error messages.
_YAML_NAMES = {
    "fcm_service_account": "fcm.service_account_file",
    "fcm_endpoint": "fcm.endpoint",
    "apns_topic": "apns.topic",
    "apns_key": "apns.key_file",
    "apns_key_id": "apns.key_id",
    "apns_team_id": "apns.team_id",
    "apns_certificate": "apns.certificate_file",
    "apns_private_key": "apns.private_key_file",
    "apns_endpoint": "apns.endpoint",
    "apns_ca_certificate": "apns.ca_file",
    "wns_package_sid": "wns.package_sid",
    "wns_secret": "wns.secret",
    "wns_token_url": "wns.token_url",
    "wns_channel_hosts": "wns.channel_hosts",
}
_APNS_KEYS = frozenset(
    {
        "key_file",
        "key_id",
        "team_id",
        "certificate_file",
        "private_key_file",
        "topic",
        "sandbox",
        "endpoint",
        "ca_file",
    }
)
_WNS_KEYS = frozenset({"package_sid", "secret", "secret_file", "token_url", "channel_hosts"})


def _validated(validate: Callable[..., None], values: dict[str, Any], where: str) -> dict[str, Any]:
    """Run a credentials validator; its first complaint becomes an error naming the YAML key."""
    try:
        validate(values=values)
    except ValidationError as error:
        field, messages = next(iter(error.message_dict.items()))
        raise ProvisioningError(f"{where}.{_YAML_NAMES.get(field, field)}: {messages[0]}") from None
    return values


def _known_keys(section: dict[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(str(key) for key in section if key not in known)
    if unknown:
        raise ProvisioningError(f"{where}.{unknown[0]}: unknown key")


def _optional_file(section: dict[str, Any], key: str, where: str, base_dir: Path) -> str:
    path = _text(section, key, where, required=False)
    return _read_file(path, f"{where}.{key}", base_dir).strip() if path else ""


def _fcm_fields(app_doc: dict[str, Any], where: str, base_dir: Path) -> dict[str, Any]:
    fcm = app_doc.get("fcm")
    if fcm is None:
        return {}
    fcm = _mapping(fcm, f"{where}.fcm")
    service_account = _read_file(
        _text(fcm, "service_account_file", f"{where}.fcm"),
        f"{where}.fcm.service_account_file",
        base_dir,
    )
    values = {
        "fcm_service_account": service_account,
        "fcm_endpoint": _text(fcm, "endpoint", f"{where}.fcm", required=False),
    }
    return _validated(credential_validation.validate_fcm, values, where)


def _apns_fields(app_doc: dict[str, Any], where: str, base_dir: Path) -> dict[str, Any]:
    """All APNs fields, so switching between key and certificate auth clears the other."""
    apns = app_doc.get("apns")
    if apns is None:
        return {}
    here = f"{where}.apns"
    apns = _mapping(apns, here)
    _known_keys(apns, _APNS_KEYS, here)
    sandbox = apns.get("sandbox", False)
    if not isinstance(sandbox, bool):
        raise ProvisioningError(f"{here}.sandbox: expected true or false")
    key = _optional_file(apns, "key_file", here, base_dir)
    certificate = _optional_file(apns, "certificate_file", here, base_dir)
    if not key and not certificate:
        raise ProvisioningError(f"{here}: give key_file, or certificate_file and private_key_file")
    values = {
        "apns_topic": _text(apns, "topic", here),
        "apns_sandbox": sandbox,
        "apns_key": key,
        "apns_key_id": _text(apns, "key_id", here, required=bool(key)),
        "apns_team_id": _text(apns, "team_id", here, required=bool(key)),
        "apns_certificate": certificate,
        "apns_private_key": _optional_file(apns, "private_key_file", here, base_dir),
        "apns_endpoint": _text(apns, "endpoint", here, required=False),
        "apns_ca_certificate": _optional_file(apns, "ca_file", here, base_dir),
    }
    _validated(credential_validation.validate_apns, values, where)
    values["apns_certificate_not_after"] = credential_validation.certificate_not_after(certificate)
    return values


def _wns_fields(app_doc: dict[str, Any], where: str, base_dir: Path) -> dict[str, Any]:
    wns = app_doc.get("wns")
    if wns is None:
        return {}
    here = f"{where}.wns"
    wns = _mapping(wns, here)
    _known_keys(wns, _WNS_KEYS, here)
    if "secret" in wns and "secret_file" in wns:
        raise ProvisioningError(f"{here}.secret_file: give secret or secret_file, not both")
    if "secret_file" in wns:
        secret = _optional_file(wns, "secret_file", here, base_dir)
    else:
        secret = _text(wns, "secret", here)
    hosts = wns.get("channel_hosts")
    if hosts is None:
        hosts = []
    if not isinstance(hosts, list) or not all(isinstance(host, str) for host in hosts):
        raise ProvisioningError(f"{here}.channel_hosts: expected a list of host patterns")
    values = {
        "wns_package_sid": _text(wns, "package_sid", here),
        "wns_secret": secret,
        "wns_token_url": _text(wns, "token_url", here, required=False),
        "wns_channel_hosts": "\n".join(host.strip() for host in hosts),
    }
    return _validated(credential_validation.validate_wns, values, where)


def _app_fields(app_doc: dict[str, Any], where: str, base_dir: Path) -> dict[str, Any]:
    return {
        **_fcm_fields(app_doc, where, base_dir),
        **_apns_fields(app_doc, where, base_dir),
        **_wns_fields(app_doc, where, base_dir),
    }


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
            apps[name] = _upsert(
                App,
                report,
                f"{tenant_name}/{name}",
                {"tenant": tenant, "name": name},
                _app_fields(app_doc, app_where, base_dir),
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
