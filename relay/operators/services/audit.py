"""The audit trail: who changed what, when and from where, whatever made the change.

Changes are captured at the model layer (`relay.operators.receivers` hands every save, delete
and many-to-many change of the audited models here), so the admin, `load_tenants`, any other
command, a shell or a future API are all recorded without each remembering to; only bulk
`QuerySet.update()` passes signals by, and the one writer of audited models that uses it
(`rotate_credentials`) announces its rows itself. Field names only, never values: most of
what is audited is a secret.

The actor comes from a context variable: the web request (set by
`middleware.AuditContextMiddleware`), an explicit `acting(...)` block, or else the process
itself, named by its command line and the host's user (`manage.py load_tenants (root@host)`).
"""

from __future__ import annotations

import contextvars
import getpass
import json
import logging
import os
import socket
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import models
from django.http import HttpRequest
from django.utils import timezone

from relay.models import ProviderCredentials
from relay.operators.models import AuditAction, AuditEntry
from relay.services import login_throttle, tenancy

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Actor:
    name: str
    user_id: int | None = None
    address: str = ""


_request: contextvars.ContextVar[HttpRequest | None] = contextvars.ContextVar(
    "relay_audit_request", default=None
)
_actor: contextvars.ContextVar[Actor | None] = contextvars.ContextVar(
    "relay_audit_actor", default=None
)


@contextmanager
def request_context(request: HttpRequest) -> Iterator[None]:
    """Changes made while answering `request` are the requesting user's."""
    token = _request.set(request)
    try:
        yield
    finally:
        _request.reset(token)


@contextmanager
def acting(actor: Actor) -> Iterator[None]:
    """Changes made in this block are `actor`'s (a command naming who runs it)."""
    token = _actor.set(actor)
    try:
        yield
    finally:
        _actor.reset(token)


def process_actor() -> Actor:
    """The running program, by its command line, and the host's user who runs it."""
    argv = sys.argv or ["python"]
    program = os.path.basename(argv[0])
    if program in ("manage.py", "django-admin") and len(argv) > 1:
        what = f"manage.py {argv[1]}"
    elif program == "__main__.py" or not program:
        what = "python"
    else:
        what = program
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return Actor(name=f"{what} ({user}@{socket.gethostname()})"[:300])


def request_actor(request: HttpRequest) -> Actor:
    address = login_throttle.client_address(request)
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return Actor(name=user.get_username(), user_id=user.pk, address=address)
    return Actor(name="anonymous", address=address)


def current_request() -> HttpRequest | None:
    return _request.get()


def current_actor() -> Actor:
    actor = _actor.get()
    if actor is not None:
        return actor
    request = _request.get()
    if request is not None:
        return request_actor(request)
    return process_actor()


def tenant_of_user(user_id: int | None) -> int | None:
    """The tenant whose staff the user is (the first, if several): they see its entries."""
    if user_id is None:
        return None
    from relay.models import TenantStaffGroup

    found: int | None = (
        TenantStaffGroup.objects.filter(group__user__pk=user_id)
        .order_by("tenant_id")
        .values_list("tenant_id", flat=True)
        .first()
    )
    return found


def tenant_of(obj: models.Model) -> int | None:
    """The tenant an audited object belongs to, if any."""
    from django.contrib.auth.models import Group

    if isinstance(obj, Group):
        binding = getattr(obj, "tenant_binding", None)
        return binding.tenant_id if binding is not None else None
    user_id = getattr(obj, "user_id", None)
    if obj._meta.label_lower == "auth.user":
        return tenant_of_user(obj.pk)
    if tenancy.tenant_path(type(obj)) is not None:
        return tenancy.owning_tenant_id(obj)
    if user_id is not None:  # a device
        return tenant_of_user(user_id)
    return None


def record(
    action: AuditAction,
    *,
    obj: models.Model | None = None,
    fields: Iterable[str] = (),
    detail: str = "",
    actor: Actor | None = None,
    tenant_id: int | None = None,
    object_type: str = "",
    object_repr: str = "",
) -> AuditEntry:
    """Write one entry; `fields` are names only."""
    actor = actor or current_actor()
    if obj is not None:
        object_type = object_type or obj._meta.label_lower
        object_repr = object_repr or _shown(obj)
        if tenant_id is None:
            tenant_id = tenant_of(obj)
    entry = AuditEntry.objects.create(
        at=timezone.now(),
        user_id=actor.user_id,
        actor=actor.name[:300],
        address=actor.address[:64],
        action=action,
        object_type=object_type[:100],
        object_id=str(obj.pk) if obj is not None and obj.pk is not None else "",
        object_repr=object_repr[:200],
        fields=sorted(fields),
        detail=detail[:300],
        tenant_id=tenant_id,
    )
    log.info(
        "audit.recorded",
        extra={"action": str(action), "object_type": object_type, "fields": sorted(fields)},
    )
    return entry


def _shown(obj: models.Model) -> str:
    try:
        return str(obj)
    except Exception:  # a half-deleted object's __str__ may follow a missing relation
        return f"{obj._meta.label_lower} {obj.pk}"


# ------------------------------------------------------------------------- field-level diffs
# Fields whose changes are bookkeeping, not anyone's decision.
IGNORED_FIELDS = frozenset(
    {
        "last_login",
        "last_used_at",
        "last_t",
        "drift",
        "throttling_failure_count",
        "throttling_failure_timestamp",
        "sign_count",
        "apns_certificate_not_after",
    }
)


def _tracked(model: type[models.Model]) -> list[models.Field[Any, Any]]:
    return [
        field
        for field in model._meta.concrete_fields
        if not field.primary_key
        and field.name not in IGNORED_FIELDS
        and not getattr(field, "auto_now", False)
        and not getattr(field, "auto_now_add", False)
    ]


def snapshot(obj: models.Model) -> dict[str, Any] | None:
    """The stored row's tracked values, before a save changes them (None: a new row)."""
    if obj.pk is None or obj._state.adding:
        return None
    model = type(obj)
    stored = model._base_manager.filter(pk=obj.pk).first()
    if stored is None:
        return None
    return {field.attname: field.value_from_object(stored) for field in _tracked(model)}


def changed_fields(obj: models.Model, before: dict[str, Any] | None) -> list[str]:
    """Names of the fields whose values differ from `before` (all set ones when new)."""
    fields = _tracked(type(obj))
    if before is None:
        return [field.name for field in fields if field.value_from_object(obj) not in (None, "")]
    return [
        field.name
        for field in fields
        if field.attname in before and field.value_from_object(obj) != before[field.attname]
    ]


def saved(obj: models.Model, *, created: bool, before: dict[str, Any] | None) -> None:
    fields = changed_fields(obj, None if created else before)
    if not created and not fields:
        return
    record(AuditAction.CREATED if created else AuditAction.CHANGED, obj=obj, fields=fields)


def deleted(obj: models.Model) -> None:
    record(AuditAction.DELETED, obj=obj)


def related_changed(obj: models.Model, field: str, action: str) -> None:
    """A many-to-many change (a user's groups, a group's permissions)."""
    verb = {"post_add": "added", "post_remove": "removed", "post_clear": "cleared"}[action]
    record(AuditAction.CHANGED, obj=obj, fields=[field], detail=f"{field} {verb}")


def credentials_changed(app: models.Model, service: str, fields: Iterable[str]) -> None:
    """An app's credentials record replaced: named as the admin's form names them
    (`<provider>_<field>`), on the app."""
    names = [f"{service}_{name}" for name in fields]
    record(AuditAction.CHANGED, obj=app, fields=names, detail=f"{service} credentials")


def credentials_rotated(model: type[models.Model], pk: Any, fields: Iterable[str]) -> None:
    obj = model._base_manager.filter(pk=pk).first()
    if obj is None:
        return
    if isinstance(obj, ProviderCredentials):  # one encrypted record: its set fields, on the app
        values = json.loads(str(obj.values)) if isinstance(obj.values, str) else {}
        fields = [f"{obj.service}_{name}" for name, value in sorted(values.items()) if value]
        obj = obj.app
    record(AuditAction.CHANGED, obj=obj, fields=fields, detail="re-encrypted with the current key")


# ------------------------------------------------------------------------------ login events
def logged_in(request: HttpRequest | None, user: Any) -> None:
    actor = request_actor(request) if request is not None else current_actor()
    actor = Actor(name=user.get_username(), user_id=user.pk, address=actor.address)
    record(AuditAction.LOGGED_IN, obj=user, actor=actor, detail="password accepted")


def logged_out(request: HttpRequest | None, user: Any, reason: str = "") -> None:
    if user is None:
        return
    address = login_throttle.client_address(request) if request is not None else ""
    actor = Actor(name=user.get_username(), user_id=user.pk, address=address)
    record(AuditAction.LOGGED_OUT, obj=user, actor=actor, detail=reason)


def login_failed(request: HttpRequest | None, username: str, detail: str) -> None:
    address = login_throttle.client_address(request) if request is not None else ""
    from django.contrib.auth import get_user_model

    user = get_user_model()._default_manager.filter(username=username).first()
    actor = Actor(name=username[:150] or "?", user_id=None, address=address)
    if user is not None:
        record(AuditAction.LOGIN_FAILED, obj=user, actor=actor, detail=detail)
    else:
        record(AuditAction.LOGIN_FAILED, actor=actor, detail=detail, object_type="auth.user")
