"""Provisioning as code: tenants, apps and components from a YAML document, idempotently.

Operators keep their setup in version control and apply it with `manage.py load_tenants`;
applying the same file twice changes nothing. The whole file applies, or nothing does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from django.db import transaction
from slixmpp.jid import JID, InvalidJID

from relay.models import App, Component, Tenant


class ProvisioningError(ValueError):
    """The document is wrong; the message names the place (e.g. tenants[0].apps[1].fcm)."""


@dataclass
class ProvisioningReport:
    counts: Counter[str] = field(default_factory=Counter)

    def note(self, kind: str, change: str) -> None:
        self.counts[f"{kind} {change}"] += 1

    def summary(self) -> str:
        return (
            ", ".join(f"{count} {what}" for what, count in sorted(self.counts.items())) or "nothing"
        )


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


def _fcm_fields(app_doc: dict[str, Any], where: str, base_dir: Path) -> dict[str, str]:
    fcm = app_doc.get("fcm")
    if fcm is None:
        return {}
    fcm = _mapping(fcm, f"{where}.fcm")
    service_account = _read_file(
        _text(fcm, "service_account_file", f"{where}.fcm"),
        f"{where}.fcm.service_account_file",
        base_dir,
    )
    from relay.providers.fcm import FcmConfig

    endpoint = _text(fcm, "endpoint", f"{where}.fcm", required=False)
    try:
        FcmConfig.parse(service_account, endpoint)
    except ValueError as error:
        raise ProvisioningError(f"{where}.fcm: {error}") from error
    return {"fcm_service_account": service_account, "fcm_endpoint": endpoint}


def _upsert(
    model: type[Any], report: ProvisioningReport, lookup: dict[str, Any], values: dict[str, Any]
) -> Any:
    obj = model.objects.filter(**lookup).first()
    kind = model._meta.verbose_name
    if obj is None:
        obj = model.objects.create(**lookup, **values)
        report.note(kind, "created")
        return obj
    changed = [name for name, value in values.items() if getattr(obj, name) != value]
    if changed:
        for name in changed:
            setattr(obj, name, values[name])
        obj.save()
        report.note(kind, "updated")
    else:
        report.note(kind, "unchanged")
    return obj


def load_tenants(document: str, *, base_dir: Path) -> ProvisioningReport:
    try:
        data = yaml.safe_load(document)
    except yaml.YAMLError as error:
        raise ProvisioningError(f"not valid YAML: {error}") from error
    data = _mapping(data, "document")
    report = ProvisioningReport()
    with transaction.atomic():
        for t_index, tenant_doc in enumerate(_list(data.get("tenants"), "tenants")):
            where = f"tenants[{t_index}]"
            tenant_doc = _mapping(tenant_doc, where)
            tenant = _upsert(
                Tenant,
                report,
                {"name": _text(tenant_doc, "name", where)},
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
                    {"tenant": tenant, "name": name},
                    _fcm_fields(app_doc, app_where, base_dir),
                )
            for c_index, comp_doc in enumerate(
                _list(tenant_doc.get("components"), f"{where}.components")
            ):
                comp_where = f"{where}.components[{c_index}]"
                _component(tenant, apps, _mapping(comp_doc, comp_where), comp_where, report)
    return report


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
    app_name = _text(doc, "app", where)
    app = apps.get(app_name) or App.objects.filter(tenant=tenant, name=app_name).first()
    if app is None:
        raise ProvisioningError(f"{where}.app: no app {app_name!r} in this tenant")
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
    _upsert(
        Component,
        report,
        {"jid": str(jid)},
        {
            "tenant": tenant,
            "app": app,
            "secret": _text(doc, "secret", where),
            "host": _text(doc, "host", where, required=False) or "127.0.0.1",
            "port": port,
            "enabled": enabled,
        },
    )
