"""Building blocks of every admin page: tenant scoping (`TenantScopedAdmin`,
`OperatorOnlyAdmin`), list lookups kept to what the lists offer, confirmations, and the
pieces the tenant, app and component pages share.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, cast

from django.contrib import admin
from django.contrib.admin import helpers
from django.contrib.admin.utils import get_fields_from_path, unquote
from django.db import models
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.fields.related import RelatedField
from django.db.models.functions import Coalesce
from django.forms import ModelChoiceField
from django.http import (
    Http404,
    HttpRequest,
)
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import capfirst

from relay.admin_charts import daily_chart
from relay.models import (
    Component,
    Delivery,
    LinkState,
)
from relay.services import tenancy, usage

LINK_COLOURS = {
    LinkState.UP: "#2e7d32",
    LinkState.CONNECTING: "#f9a825",
    LinkState.DOWN: "#c62828",
    "unknown": "#8d8d8d",
    "disabled": "#8d8d8d",
}


# --------------------------------------------------------------------------- building blocks
class ScopedRelatedFieldListFilter(admin.RelatedFieldListFilter):
    """A related-object filter whose choices are only the user's tenants' objects."""

    def field_choices(
        self, field: RelatedField[Any, Any], request: HttpRequest, model_admin: admin.ModelAdmin
    ) -> list[tuple[Any, Any]]:
        ordering = self.field_admin_ordering(field, request, model_admin)
        limit = tenancy.scope_q(field.related_model, user=request.user)
        choices = field.get_choices(include_blank=False, ordering=ordering, limit_choices_to=limit)
        return cast(list[tuple[Any, Any]], choices)


def is_operator_request(request: HttpRequest) -> bool:
    return tenancy.is_operator(request.user)


def confirm(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Any],
    *,
    action: str,
    title: str,
    consequence: str,
) -> TemplateResponse | None:
    """An intermediate page for a destructive action; None once the user confirmed it."""
    if request.POST.get("post") == "yes":
        return None
    context = {
        **model_admin.admin_site.each_context(request),
        "title": title,
        "consequence": consequence,
        "objects": list(queryset),
        "action": action,
        "opts": model_admin.model._meta,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": model_admin.media,
    }
    return TemplateResponse(request, "admin/relay/confirm_action.html", context)


def change_message(model: type[models.Model], *fields: str) -> list[dict[str, Any]]:
    """A history entry naming the changed fields (as the forms label them), never values."""
    names = [
        capfirst(cast("models.Field[Any, Any]", model._meta.get_field(name)).verbose_name)
        for name in fields
    ]
    return [{"changed": {"fields": names}}]


def annotated_count(obj: models.Model, name: str) -> int:
    """A count the admin's queryset annotated on the row (the model does not declare it)."""
    value: int = getattr(obj, name)
    return value


def link_badge(state: str) -> SafeString:
    colour = LINK_COLOURS.get(state, "#8d8d8d")
    return format_html(
        '<span class="relay-link relay-link-{}" style="color:{};font-weight:bold">● {}</span>',
        state,
        colour,
        state,
    )


def count_subquery(queryset: QuerySet[Any], link: str) -> Coalesce:
    """Count rows of `queryset` whose `link` is the outer row, without join fan-out."""
    counted = (
        queryset.filter(**{link: OuterRef("pk")})
        .order_by()
        .values(link)
        .annotate(count=Count("pk"))
        .values("count")
    )
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


def pushes_since(hours: int) -> QuerySet[Delivery]:
    return Delivery.objects.filter(received__gte=timezone.now() - timedelta(hours=hours))


# The terms a list filter, the date bar or one of our links put after a filtered field.
LIST_LOOKUP_TERMS = frozenset(
    {"exact", "isnull", "in", "gt", "gte", "lt", "lte", "isempty", "year", "month", "day"}
)


class ReadOnlyAdmin:
    """Records of what happened: shown and exported, never added, edited or deleted here."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ListLookupsOnly(admin.ModelAdmin):
    """Allows only the URL lookups the list's own filters, date bar and links need.

    Django allows any lookup on a model's own fields, so `?secret__startswith=a` on a list
    answered "some rows" or "none" about a value the page never shows: a prefix loop read a
    component secret back. Here a lookup must name a field of `list_filter`, `date_hierarchy`
    or `extra_lookup_fields` (followed at most by the related object's key and one term of
    `LIST_LOOKUP_TERMS`), or a SimpleListFilter's parameter; anything else is refused with
    400 for every user. Hidden fields (secrets, tokens, credentials, hashes) are never
    filters, so they can never be probed.
    """

    # Fields our own links filter by without offering a filter for them.
    extra_lookup_fields: Sequence[str] = ()

    def _lookup_fields_and_parameters(self, request: HttpRequest) -> tuple[set[str], set[str]]:
        fields = set(self.extra_lookup_fields)
        parameters: set[str] = set()
        for entry in self.get_list_filter(request):
            if isinstance(entry, str):
                fields.add(entry)
            elif isinstance(entry, list | tuple):
                fields.add(cast(str, entry[0]))
            elif isinstance(entry, type) and issubclass(entry, admin.SimpleListFilter):
                parameters.add(cast(str, entry.parameter_name))
        if self.date_hierarchy:
            fields.add(self.date_hierarchy)
        return fields, parameters

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        fields, parameters = self._lookup_fields_and_parameters(request)
        if lookup in parameters or lookup in fields:
            return True
        for field_path in fields:
            if not lookup.startswith(field_path + "__"):
                continue
            rest = lookup[len(field_path) + 2 :].split("__")
            field = get_fields_from_path(self.model, field_path)[-1]
            related = cast(type[models.Model], field.related_model)
            if field.is_relation and rest[0] in {"pk", "id", related._meta.pk.name}:
                rest = rest[1:]
            if not rest or (len(rest) == 1 and rest[0] in LIST_LOOKUP_TERMS):
                return True
        return False


class TenantScopedAdmin(ListLookupsOnly):
    """Confines a tenant's own staff to their tenants' rows; the operator sees everything.

    `operator_only_fields` are shown read-only to tenant staff; `operator_only_actions` are
    not offered to them at all.
    """

    operator_only_fields: Sequence[str] = ()
    operator_only_actions: Sequence[str] = ()

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return tenancy.scope_queryset(super().get_queryset(request), user=request.user)

    def formfield_for_foreignkey(
        self, db_field: models.ForeignKey[Any, Any], request: HttpRequest, **kwargs: Any
    ) -> ModelChoiceField[Any] | None:
        formfield = super().formfield_for_foreignkey(db_field, request, **kwargs)
        if formfield is not None and hasattr(formfield, "queryset"):
            queryset = cast(QuerySet[Any], formfield.queryset)
            formfield.queryset = tenancy.scope_queryset(queryset, user=request.user)
        return formfield

    def get_list_filter(self, request: HttpRequest) -> list[Any]:
        scoped: list[Any] = []
        for entry in super().get_list_filter(request):
            if isinstance(entry, str) and get_fields_from_path(self.model, entry)[-1].is_relation:
                entry = (entry, ScopedRelatedFieldListFilter)
            scoped.append(entry)
        return scoped

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = list(super().get_readonly_fields(request, obj))
        if not is_operator_request(request):
            fields += [name for name in self.operator_only_fields if name not in fields]
        return fields

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        if not is_operator_request(request):
            for name in self.operator_only_actions:
                actions.pop(name, None)
        return actions

    def _in_scope(self, request: HttpRequest, obj: Any) -> bool:
        return obj is None or tenancy.in_scope(obj, user=request.user)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_view_permission(request, obj) and self._in_scope(request, obj)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_change_permission(request, obj) and self._in_scope(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_delete_permission(request, obj) and self._in_scope(request, obj)

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        """A tenant's staff of one tenant find it already chosen in new objects."""
        initial = cast(dict[str, Any], super().get_changeform_initial_data(request))
        scope = tenancy.tenant_ids_for(request.user)
        names = {field.name for field in self.model._meta.get_fields()}
        if "tenant" in names and "tenant" not in initial and scope is not None and len(scope) == 1:
            initial["tenant"] = next(iter(scope))
        return initial

    def has_operator_permission(self, request: HttpRequest) -> bool:
        """For actions only the operator's staff may run (`permissions=["operator"]`)."""
        return is_operator_request(request) and self.has_change_permission(request)

    def get_object_or_404(self, request: HttpRequest, object_id: str) -> Any:
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404
        return obj


class ScopedInline(admin.TabularInline):
    """An inline on the tenant page: the tenant's rows only, read-only, linked to their page."""

    extra = 0
    can_delete = False
    show_change_link = True

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return tenancy.scope_queryset(super().get_queryset(request), user=request.user)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class OperatorOnlyAdmin(ListLookupsOnly):
    """Models that belong to no tenant: a tenant's own staff never see them."""

    def has_module_permission(self, request: HttpRequest) -> bool:
        return is_operator_request(request) and super().has_module_permission(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_operator_request(request) and super().has_view_permission(request, obj)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return is_operator_request(request) and super().has_add_permission(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_operator_request(request) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_operator_request(request) and super().has_delete_permission(request, obj)


def component_link_state(component: Component) -> str:
    if not component.enabled:
        return "disabled"
    link = getattr(component, "link", None)
    return link.state if link is not None else "unknown"


def usage_panel(
    *, tenant_ids: Iterable[int] | None, app_ids: Iterable[int] | None = None
) -> SafeString:
    """The usage table (last day, last 30 days, per provider) and the 30-day chart."""
    tenant_ids = list(tenant_ids) if tenant_ids is not None else None
    app_ids = list(app_ids) if app_ids is not None else None
    rows = usage.usage_table(tenant_ids=tenant_ids, app_ids=app_ids)
    day, month = usage.totals(rows)
    chart = daily_chart(usage.daily_counts(tenant_ids=tenant_ids, app_ids=app_ids))
    return render_to_string(
        "admin/relay/usage_panel.html",
        {"rows": rows, "day_total": day, "month_total": month, "chart": chart},
    )
