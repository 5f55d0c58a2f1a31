"""Who sees which tenant's objects in the admin.

A staff user in a group bound to a tenant (`TenantStaffGroup`) is that tenant's own staff and
is confined to its objects everywhere in the admin, whatever permissions the group holds. The
operator's staff are explicit: superusers, and users holding `relay.operate_all_tenants`
(the "Operators" group made by migration 0004) who are in no bound group; they see everything
their permissions allow. Everyone else sees nothing: a group whose tenant binding was removed
keeps its permissions but reaches no tenant (fail closed). The scope is computed once per
request (it is cached on the request's user object).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from django.contrib.auth.models import Group, Permission
from django.db import models, transaction
from django.db.models import Q, QuerySet

from relay.models import (
    App,
    Component,
    ComponentLink,
    DeadLetter,
    Delivery,
    Registration,
    Tenant,
    TenantStaffGroup,
)

M = TypeVar("M", bound=models.Model)

OPERATOR_PERMISSION = "relay.operate_all_tenants"
OPERATORS_GROUP = "Operators"

# How each tenant-owned model reaches its tenant; a model missing here is operator-only.
TENANT_PATHS: dict[type[models.Model], str] = {
    Tenant: "pk",
    App: "tenant",
    Component: "tenant",
    ComponentLink: "component__tenant",
    Registration: "app__tenant",
    Delivery: "tenant",
    DeadLetter: "tenant",
    TenantStaffGroup: "tenant",
}

# What a new tenant staff group may do; credentials stay write-only for them in any case, and
# adding or removing tenants and components stays the operator's whatever the permissions.
DEFAULT_STAFF_PERMISSIONS: tuple[str, ...] = (
    "view_tenant",
    "change_tenant",
    "view_app",
    "add_app",
    "change_app",
    "view_component",
    "change_component",
    "view_componentlink",
    "view_registration",
    "change_registration",
    "delete_registration",
    "view_delivery",
    "view_deadletter",
    "change_deadletter",
)
# Feature apps' permissions a new staff group gets too, as (app label, codename).
_FEATURE_STAFF_PERMISSIONS: list[tuple[str, str]] = []


def register_tenant_owned(
    model: type[models.Model], path: str, *, staff_permissions: Iterable[str] = ()
) -> None:
    """A feature app's model that belongs to a tenant (through `path`), declared in its
    AppConfig.ready: the admin scopes it like the core's, and new staff groups get
    `staff_permissions` (codenames of the model's app)."""
    TENANT_PATHS[model] = path
    label = model._meta.app_label
    for codename in staff_permissions:
        if (label, codename) not in _FEATURE_STAFF_PERMISSIONS:
            _FEATURE_STAFF_PERMISSIONS.append((label, codename))


_CACHE_ATTRIBUTE = "_relay_tenant_scope"


def tenant_ids_for(user: Any) -> frozenset[int] | None:
    """The tenants a user may see: None means all (the operator), an empty set means none."""
    cached: frozenset[int] | bool | None = getattr(user, _CACHE_ATTRIBUTE, False)
    if not isinstance(cached, bool):
        return cached
    scope: frozenset[int] | None
    if not getattr(user, "is_active", False) or not user.is_authenticated:
        scope = frozenset()
    elif user.is_superuser:
        scope = None
    else:
        bound = frozenset(
            TenantStaffGroup.objects.filter(group__user=user).values_list("tenant_id", flat=True)
        )
        # A binding confines even a holder of the operator permission (a tenant group given
        # "every permission" must not open every tenant); without one, only the explicit
        # permission makes an operator, and everyone else sees nothing.
        if bound:
            scope = bound
        elif user.is_staff and user.has_perm(OPERATOR_PERMISSION):
            scope = None
        else:
            scope = frozenset()
    # AnonymousUser has no instance dict worth caching on; everyone else does.
    if user.is_authenticated:
        setattr(user, _CACHE_ATTRIBUTE, scope)
    return scope


def is_tenant_staff(user: Any) -> bool:
    """Confined to some tenants (possibly none): everyone who is not the operator's."""
    return tenant_ids_for(user) is not None


def is_operator(user: Any) -> bool:
    return tenant_ids_for(user) is None


def tenant_path(model: type[models.Model]) -> str | None:
    return TENANT_PATHS.get(model)


def scope_queryset(queryset: QuerySet[M], *, user: Any) -> QuerySet[M]:
    """Only the rows the user's tenants own; all rows for the operator.

    A model that belongs to no tenant is operator-only: tenant staff get nothing of it.
    """
    tenant_ids = tenant_ids_for(user)
    if tenant_ids is None:
        return queryset
    path = tenant_path(queryset.model)
    if path is None:
        return queryset.none()
    return queryset.filter(**{f"{path}__in": tenant_ids})


def scope_q(model: type[models.Model], *, user: Any) -> Q | None:
    """A filter for choice lists built outside a queryset (list filters); None: no limit."""
    tenant_ids = tenant_ids_for(user)
    if tenant_ids is None:
        return None
    path = tenant_path(model)
    if path is None:
        return Q(pk__in=[])
    return Q(**{f"{path}__in": tenant_ids})


def owning_tenant_id(obj: models.Model) -> int | None:
    """The tenant an object belongs to, following its `TENANT_PATHS` entry."""
    path = tenant_path(type(obj))
    if path is None:
        return None
    if path == "pk":
        return obj.pk
    value: Any = obj
    for part in path.split("__"):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value.pk


def in_scope(obj: models.Model, *, user: Any) -> bool:
    tenant_ids = tenant_ids_for(user)
    if tenant_ids is None:
        return True
    tenant_id = owning_tenant_id(obj)
    return tenant_id is not None and tenant_id in tenant_ids


@transaction.atomic
def create_staff_group(
    *, tenant: Tenant, name: str = "", permissions: Iterable[str] = DEFAULT_STAFF_PERMISSIONS
) -> Group:
    """A group bound to the tenant with the default staff permissions; add users to it."""
    group, _ = Group.objects.get_or_create(name=name or f"{tenant.name} staff")
    binding = TenantStaffGroup.objects.filter(group=group).exclude(tenant=tenant).first()
    if binding is not None:
        raise ValueError(f"the group {group.name!r} is bound to another tenant")
    operator_codename = OPERATOR_PERMISSION.split(".", 1)[1]
    if (
        operator_codename in permissions
        or group.permissions.filter(
            codename=operator_codename, content_type__app_label="relay"
        ).exists()
    ):
        raise ValueError(f"the group {group.name!r} holds the operator permission")
    wanted = Q(content_type__app_label="relay", codename__in=permissions)
    if permissions is DEFAULT_STAFF_PERMISSIONS:
        for label, codename in _FEATURE_STAFF_PERMISSIONS:
            wanted |= Q(content_type__app_label=label, codename=codename)
    group.permissions.add(*Permission.objects.filter(wanted))
    TenantStaffGroup.objects.update_or_create(group=group, defaults={"tenant": tenant})
    return group


def unconfined_staff_count() -> int:
    """Active staff who are neither superusers, operators nor bound to a tenant.

    They see nothing since operator status became explicit; a system check names their number
    so an upgrade that confined the operator's own people is noticed.
    """
    from django.contrib.auth import get_user_model

    app_label, codename = OPERATOR_PERMISSION.split(".", 1)
    users = get_user_model().objects.filter(is_active=True, is_staff=True, is_superuser=False)
    direct = {
        "user_permissions__codename": codename,
        "user_permissions__content_type__app_label": app_label,
    }
    via_group = {
        "groups__permissions__codename": codename,
        "groups__permissions__content_type__app_label": app_label,
    }
    holders = users.filter(Q(**direct) | Q(**via_group))
    bound = users.filter(groups__tenant_binding__isnull=False)
    return users.exclude(pk__in=holders.values("pk")).exclude(pk__in=bound.values("pk")).count()


def bound_operator_groups() -> list[str]:
    """Tenant staff groups that also hold the operator permission (the binding wins)."""
    app_label, codename = OPERATOR_PERMISSION.split(".", 1)
    return list(
        Group.objects.filter(
            tenant_binding__isnull=False,
            permissions__codename=codename,
            permissions__content_type__app_label=app_label,
        ).values_list("name", flat=True)
    )
