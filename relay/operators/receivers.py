"""Signal receivers: each hands what happened to the audit service, which only records it.

Model signals are used for the audit because they see every save and delete of the audited
models, whichever code path made it (admin, commands, shell); they hold no business logic.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import Group, User
from django.contrib.auth.signals import user_logged_in, user_logged_out, user_login_failed
from django.db import models
from django.db.models.signals import m2m_changed, post_delete, post_save, pre_save
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from relay.models import App, Component, Tenant, TenantStaffGroup
from relay.operators.models import TenantSecurityPolicy, WebAuthnKey
from relay.operators.services import audit, second_factor, sessions
from relay.services.credentials import keys, records

AUDITED: tuple[type[models.Model], ...] = (
    Tenant,
    App,
    Component,
    TenantStaffGroup,
    TenantSecurityPolicy,
    User,
    Group,
    TOTPDevice,
    StaticDevice,
    WebAuthnKey,
)
DEVICES: tuple[type[models.Model], ...] = (TOTPDevice, StaticDevice, WebAuthnKey)
_BEFORE = "_relay_audit_before"


def _before_save(sender: type[models.Model], instance: models.Model, **kwargs: Any) -> None:
    if kwargs.get("raw"):
        return
    setattr(instance, _BEFORE, audit.snapshot(instance))


def _after_save(
    sender: type[models.Model], instance: models.Model, created: bool, **kwargs: Any
) -> None:
    if kwargs.get("raw"):
        return
    audit.saved(instance, created=created, before=getattr(instance, _BEFORE, None))


def _after_delete(sender: type[models.Model], instance: models.Model, **kwargs: Any) -> None:
    audit.deleted(instance)


def _device_added_or_removed(sender: type[models.Model], instance: Any, **kwargs: Any) -> None:
    """A new or removed second factor ends the owner's other sessions."""
    if kwargs.get("raw") or (kwargs.get("created") is False):
        return
    sessions.end_everywhere_for_device_change(instance.user_id)


for model in AUDITED:
    uid = model._meta.label_lower
    pre_save.connect(_before_save, sender=model, dispatch_uid=f"audit.pre_save.{uid}")
    post_save.connect(_after_save, sender=model, dispatch_uid=f"audit.post_save.{uid}")
    post_delete.connect(_after_delete, sender=model, dispatch_uid=f"audit.post_delete.{uid}")
for model in DEVICES:
    uid = model._meta.label_lower
    post_save.connect(_device_added_or_removed, sender=model, dispatch_uid=f"sessions.{uid}")
    post_delete.connect(_device_added_or_removed, sender=model, dispatch_uid=f"sessions.del.{uid}")


def _m2m(field: str) -> Any:
    def receiver(sender: Any, instance: models.Model, action: str, reverse: bool, **_: Any) -> None:
        if action in ("post_add", "post_remove", "post_clear"):
            name = field if not reverse else f"{sender._meta.model_name}"
            audit.related_changed(instance, name, action)

    return receiver


_M2M_RECEIVERS = {
    "groups": _m2m("groups"),
    "user_permissions": _m2m("user_permissions"),
    "permissions": _m2m("permissions"),
}
m2m_changed.connect(
    _M2M_RECEIVERS["groups"], sender=User.groups.through, dispatch_uid="audit.m2m.groups"
)
m2m_changed.connect(
    _M2M_RECEIVERS["user_permissions"],
    sender=User.user_permissions.through,
    dispatch_uid="audit.m2m.user_permissions",
)
m2m_changed.connect(
    _M2M_RECEIVERS["permissions"],
    sender=Group.permissions.through,
    dispatch_uid="audit.m2m.permissions",
)


def _rotated(sender: type[models.Model], pk: Any, fields: list[str], **_: Any) -> None:
    audit.credentials_rotated(sender, pk, fields)


keys.credentials_rotated.connect(_rotated, dispatch_uid="audit.credentials_rotated")


def _credentials_changed(sender: Any, app: App, service: str, fields: list[str], **_: Any) -> None:
    audit.credentials_changed(app, service, fields)


records.credentials_changed.connect(_credentials_changed, dispatch_uid="audit.credentials_changed")


def _logged_in(sender: Any, request: Any, user: Any, **_: Any) -> None:
    sessions.started(request)
    audit.logged_in(request, user)
    if request is not None:
        second_factor.password_accepted(request, user)


def _logged_out(sender: Any, request: Any, user: Any, **_: Any) -> None:
    reason = getattr(request, "relay_logout_reason", "") if request is not None else ""
    audit.logged_out(request, user, reason)


def _login_failed(sender: Any, credentials: dict[str, Any], request: Any = None, **_: Any) -> None:
    if credentials.get("relay_second_step"):
        return  # the second step records its own failure (services.second_factor)
    audit.login_failed(request, str(credentials.get("username", "")), "wrong password")


user_logged_in.connect(_logged_in, dispatch_uid="operators.logged_in")
user_logged_out.connect(_logged_out, dispatch_uid="operators.logged_out")
user_login_failed.connect(_login_failed, dispatch_uid="operators.login_failed")
