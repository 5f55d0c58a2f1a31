"""The Django admin: where the hosting provider's staff run the service, and where a tenant's
own staff look after their part and nothing else.

- Every tenant-owned model's admin derives from `TenantScopedAdmin`: lists, forms, choice
  lists, list filters, searches, actions and object pages only reach the rows of the user's
  tenants (`relay.services.tenancy`). Admins of other models are `OperatorOnlyAdmin`.
- Credentials are write-only (`relay.forms.AppForm`, `ComponentForm`); change messages in the
  history list field names, never values. Tokens and registration secrets are never shown.
- Registrations are found by node or account domain: there is no JID to search by, and the
  admin must not invent one.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import get_fields_from_path, unquote
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.core.exceptions import PermissionDenied
from django.db import models
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    StreamingHttpResponse,
)
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import capfirst

from relay.admin_charts import daily_chart
from relay.forms import APP_FIELDSETS, AppForm
from relay.models import (
    App,
    Component,
    DeadLetter,
    Delivery,
    LinkState,
    Registration,
    Tenant,
    TenantStaffGroup,
    UnifiedPushDelivery,
)
from relay.services import credentials as credential_service
from relay.services import dead_letters, link_leases, onboarding, tenancy, usage
from relay.services.provisioning import validate_unifiedpush_url
from relay.services.queue import QueueUnavailable
from relay.services.test_push import send_test_push

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
        self, field: models.Field, request: HttpRequest, model_admin: admin.ModelAdmin
    ) -> list[tuple[Any, str]]:
        ordering = self.field_admin_ordering(field, request, model_admin)
        limit = tenancy.scope_q(field.related_model, user=request.user)
        return field.get_choices(include_blank=False, ordering=ordering, limit_choices_to=limit)


def _is_operator(request: HttpRequest) -> bool:
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
    names = [capfirst(model._meta.get_field(name).verbose_name) for name in fields]
    return [{"changed": {"fields": names}}]


def link_badge(state: str) -> SafeString:
    colour = LINK_COLOURS.get(state, "#8d8d8d")
    return format_html(
        '<span class="relay-link relay-link-{}" style="color:{};font-weight:bold">● {}</span>',
        state,
        colour,
        state,
    )


def _count_subquery(queryset: QuerySet[Any], link: str) -> Coalesce:
    """Count rows of `queryset` whose `link` is the outer row, without join fan-out."""
    counted = (
        queryset.filter(**{link: OuterRef("pk")})
        .order_by()
        .values(link)
        .annotate(count=Count("pk"))
        .values("count")
    )
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


def _pushes_since(hours: int) -> QuerySet[Delivery]:
    return Delivery.objects.filter(received__gte=timezone.now() - timedelta(hours=hours))


# The terms a list filter, the date bar or one of our links put after a filtered field.
LIST_LOOKUP_TERMS = frozenset(
    {"exact", "isnull", "in", "gt", "gte", "lt", "lte", "isempty", "year", "month", "day"}
)


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
                fields.add(entry[0])
            elif isinstance(entry, type) and issubclass(entry, admin.SimpleListFilter):
                parameters.add(entry.parameter_name)
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
            if field.is_relation and rest[0] in {"pk", "id", field.related_model._meta.pk.name}:
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
        self, db_field: models.ForeignKey, request: HttpRequest, **kwargs: Any
    ) -> forms.Field | None:
        formfield = super().formfield_for_foreignkey(db_field, request, **kwargs)
        if formfield is not None and hasattr(formfield, "queryset"):
            formfield.queryset = tenancy.scope_queryset(formfield.queryset, user=request.user)
        return formfield

    def get_list_filter(self, request: HttpRequest) -> Sequence[Any]:
        scoped: list[Any] = []
        for entry in super().get_list_filter(request):
            if isinstance(entry, str) and get_fields_from_path(self.model, entry)[-1].is_relation:
                entry = (entry, ScopedRelatedFieldListFilter)
            scoped.append(entry)
        return scoped

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Sequence[str]:
        fields = list(super().get_readonly_fields(request, obj))
        if not _is_operator(request):
            fields += [name for name in self.operator_only_fields if name not in fields]
        return fields

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        if not _is_operator(request):
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
        initial = super().get_changeform_initial_data(request)
        scope = tenancy.tenant_ids_for(request.user)
        names = {field.name for field in self.model._meta.get_fields()}
        if "tenant" in names and "tenant" not in initial and scope is not None and len(scope) == 1:
            initial["tenant"] = next(iter(scope))
        return initial

    def has_operator_permission(self, request: HttpRequest) -> bool:
        """For actions only the operator's staff may run (`permissions=["operator"]`)."""
        return _is_operator(request) and self.has_change_permission(request)

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
        return _is_operator(request) and super().has_module_permission(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _is_operator(request) and super().has_view_permission(request, obj)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return _is_operator(request) and super().has_add_permission(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _is_operator(request) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _is_operator(request) and super().has_delete_permission(request, obj)


# --------------------------------------------------------------------------- tenants
class AppInline(ScopedInline):
    model = App
    fields = ("name", "public_key", "credentials")
    readonly_fields = fields
    verbose_name_plural = "apps (their provider credentials are on each app's page)"

    @admin.display(description="credentials")
    def credentials(self, obj: App) -> str:
        return format_html_join(
            mark_safe("<br>"), "{}: {}", credential_service.credential_summary(app=obj)
        )


class ComponentInline(ScopedInline):
    model = Component
    fields = ("jid", "app", "enabled", "link_state", "pushes_last_hour")
    readonly_fields = fields
    verbose_name_plural = "components (links to the tenant's XMPP servers)"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return (
            super()
            .get_queryset(request)
            .select_related("app", "link")
            .annotate(
                pushes=_count_subquery(
                    _pushes_since(1).filter(registration__isnull=False),
                    "registration__component",
                )
            )
        )

    # Not named "link": that is the reverse relation to ComponentLink, which would win.
    @admin.display(description="link")
    def link_state(self, obj: Component) -> SafeString:
        return link_badge(_link_state(obj))

    @admin.display(description="pushes in the last hour")
    def pushes_last_hour(self, obj: Component) -> int:
        return getattr(obj, "pushes", 0)


class StaffGroupInline(admin.TabularInline):
    """Binds auth groups to the tenant: their members become the tenant's own staff."""

    model = TenantStaffGroup
    extra = 0
    fields = ("group",)
    verbose_name_plural = "staff groups (members see and change only this tenant)"

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _is_operator(request) and super().has_view_permission(request, obj)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _is_operator(request) and super().has_add_permission(request, obj)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _is_operator(request) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _is_operator(request) and super().has_delete_permission(request, obj)


def _link_state(component: Component) -> str:
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


@admin.register(Tenant)
class TenantAdmin(TenantScopedAdmin):
    list_display = ("name", "display_name", "status", "apps", "links_up", "pushes_day", "created")
    list_filter = ("suspended",)
    search_fields = ("name", "display_name")
    readonly_fields = ("onboarding", "usage")
    operator_only_fields = ("name", "suspended", "rate_limit_per_second", "rate_limit_burst")
    operator_only_actions = ("suspend", "resume", "create_staff_group", "delete_selected")
    inlines = (AppInline, ComponentInline, StaffGroupInline)
    formfield_overrides = {
        models.TextField: {"widget": forms.Textarea(attrs={"rows": 3, "cols": 60})}
    }
    actions = ("suspend", "resume", "create_staff_group")

    def has_add_permission(self, request: HttpRequest) -> bool:
        # A tenant's staff look after their tenant; making or removing tenants is the operator's.
        return _is_operator(request) and super().has_add_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Tenant | None = None) -> bool:
        return _is_operator(request) and super().has_delete_permission(request, obj)

    def get_fieldsets(self, request: HttpRequest, obj: Tenant | None = None) -> list[Any]:
        fieldsets: list[Any] = [
            (None, {"fields": ("name", "display_name")}),
            (
                "Policy",
                {
                    "fields": (
                        "suspended",
                        "allowed_domains",
                        ("rate_limit_per_second", "rate_limit_burst"),
                    ),
                    "description": "A suspended tenant's publishes are answered with a "
                    "temporary <code>wait</code> error: users' servers keep their "
                    "registrations, and nothing is sent until the tenant is resumed.",
                },
            ),
        ]
        if obj is not None:
            fieldsets += [
                ("Onboarding", {"fields": ("onboarding",)}),
                ("Usage", {"fields": ("usage",)}),
            ]
        return fieldsets

    def get_queryset(self, request: HttpRequest) -> QuerySet[Tenant]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                app_count=_count_subquery(App.objects.all(), "tenant"),
                component_count=_count_subquery(Component.objects.filter(enabled=True), "tenant"),
                up_count=_count_subquery(
                    Component.objects.filter(enabled=True, link__state=LinkState.UP), "tenant"
                ),
                day_count=_count_subquery(_pushes_since(24), "tenant"),
            )
        )

    @admin.display(description="status", ordering="suspended")
    def status(self, obj: Tenant) -> SafeString:
        if obj.suspended:
            return format_html('<strong style="color:#c62828">{}</strong>', "suspended")
        return mark_safe("active")

    @admin.display(description="apps", ordering="app_count")
    def apps(self, obj: Tenant) -> int:
        return obj.app_count

    @admin.display(description="links up")
    def links_up(self, obj: Tenant) -> str:
        return f"{obj.up_count} / {obj.component_count}"

    @admin.display(description="pushes, last 24 h", ordering="day_count")
    def pushes_day(self, obj: Tenant) -> int:
        return obj.day_count

    @admin.display(description="next steps")
    def onboarding(self, obj: Tenant) -> SafeString:
        apps = list(obj.apps.all())
        components = list(obj.components.select_related("link"))
        up = sum(1 for component in components if _link_state(component) == LinkState.UP)
        query = f"?tenant={obj.pk}"
        if apps:
            query += f"&app={apps[0].pk}"
        return render_to_string(
            "admin/relay/onboarding.html",
            {
                "tenant": obj,
                "apps": apps,
                "components": components,
                "up": up,
                "add_app_url": reverse("admin:relay_app_add") + f"?tenant={obj.pk}",
                "add_component_url": reverse("admin:relay_component_add") + query,
                "staff_groups": list(obj.staff_groups.select_related("group")),
            },
        )

    @admin.display(description="pushes")
    def usage(self, obj: Tenant) -> SafeString:
        return usage_panel(tenant_ids=[obj.pk])

    def response_add(
        self, request: HttpRequest, obj: Tenant, post_url_continue: str | None = None
    ) -> HttpResponse:
        # Onboarding goes on from the tenant's page: its next steps say what is missing.
        if "_addanother" not in request.POST and "_popup" not in request.POST:
            messages.info(request, "Now add the tenant's apps and components (next steps below).")
            return HttpResponseRedirect(reverse("admin:relay_tenant_change", args=[obj.pk]))
        return super().response_add(request, obj, post_url_continue)

    def _set_suspended(
        self, request: HttpRequest, queryset: QuerySet[Tenant], suspended: bool
    ) -> int:
        changed = 0
        for tenant in queryset.filter(suspended=not suspended):
            tenant.suspended = suspended
            tenant.save(update_fields=["suspended"])
            self.log_change(request, tenant, change_message(Tenant, "suspended"))
            changed += 1
        return changed

    @admin.action(description="Suspend the selected tenants", permissions=["operator"])
    def suspend(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> HttpResponse | None:
        page = confirm(
            self,
            request,
            queryset,
            action="suspend",
            title="Suspend these tenants?",
            consequence="Their users' servers get a temporary 'wait' answer to every publish: "
            "nothing is sent to phones until you resume them, and registrations survive.",
        )
        if page is not None:
            return page
        changed = self._set_suspended(request, queryset, True)
        self.message_user(request, f"Suspended {changed} tenant(s).", messages.SUCCESS)
        return None

    @admin.action(description="Resume the selected tenants", permissions=["operator"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        changed = self._set_suspended(request, queryset, False)
        self.message_user(request, f"Resumed {changed} tenant(s).", messages.SUCCESS)

    @admin.action(
        description="Create a staff group for the selected tenants", permissions=["operator"]
    )
    def create_staff_group(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        for tenant in queryset:
            try:
                group = tenancy.create_staff_group(tenant=tenant)
            except ValueError as error:
                self.message_user(request, str(error), messages.ERROR)
                continue
            self.log_change(request, tenant, f"Bound the staff group {group.name}.")
            self.message_user(
                request,
                format_html(
                    'Staff group <a href="{}">{}</a> is bound to {}: add its users to it '
                    "(they need “staff status”).",
                    reverse("admin:auth_group_change", args=[group.pk]),
                    group.name,
                    tenant,
                ),
                messages.SUCCESS,
            )


# --------------------------------------------------------------------------- apps
@admin.register(App)
class AppAdmin(TenantScopedAdmin):
    # Credentials are write-only (AppForm) and shown as fingerprints (`credentials`).
    form = AppForm
    readonly_fields = ("credentials", "usage")
    list_display = (
        "name",
        "tenant",
        "credentials",
        "certificate_expiry",
        "registrations",
        "pushes_day",
        "updated",
    )
    list_filter = ("tenant",)
    search_fields = ("name", "tenant__name")
    list_select_related = ("tenant",)

    def get_fieldsets(self, request: HttpRequest, obj: App | None = None) -> list[Any]:
        fieldsets: list[Any] = [
            (None, {"fields": (*APP_FIELDSETS[0][1]["fields"], "credentials")}),
            *APP_FIELDSETS[1:],
        ]
        if obj is not None:
            fieldsets.append(("Usage", {"fields": ("usage",)}))
        return fieldsets

    def get_queryset(self, request: HttpRequest) -> QuerySet[App]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                registration_count=_count_subquery(Registration.objects.all(), "app"),
                day_count=_count_subquery(_pushes_since(24), "app"),
            )
        )

    @admin.display(description="credentials")
    def credentials(self, obj: App) -> str:
        return format_html_join(
            mark_safe("<br>"), "{}: {}", credential_service.credential_summary(app=obj)
        )

    @admin.display(description="APNs certificate", ordering="apns_certificate_not_after")
    def certificate_expiry(self, obj: App) -> str:
        not_after = obj.apns_certificate_not_after
        if not not_after or not credential_service.expiry_warning(app=obj):
            return ""
        verb = "expired" if not_after <= timezone.now() else "expires"
        return f"⚠ {verb} {not_after:%Y-%m-%d}"

    @admin.display(description="registrations", ordering="registration_count")
    def registrations(self, obj: App) -> int:
        return obj.registration_count

    @admin.display(description="pushes, last 24 h", ordering="day_count")
    def pushes_day(self, obj: App) -> int:
        return obj.day_count

    @admin.display(description="pushes")
    def usage(self, obj: App) -> SafeString:
        return usage_panel(tenant_ids=[obj.tenant_id], app_ids=[obj.pk])

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        if request.method == "GET":
            app = self.get_object(request, unquote(object_id))
            warning = credential_service.expiry_warning(app=app) if app is not None else ""
            if warning:
                messages.warning(request, warning)
        return super().change_view(request, object_id, form_url, extra_context)

    def response_add(
        self, request: HttpRequest, obj: App, post_url_continue: str | None = None
    ) -> HttpResponse:
        # Added from the tenant's next steps: back there, where the component comes next.
        if request.GET.get("tenant") and not {"_continue", "_addanother", "_popup"} & set(
            request.POST
        ):
            messages.success(request, f"Added the app {obj.name}. Next: its component.")
            return HttpResponseRedirect(reverse("admin:relay_tenant_change", args=[obj.tenant_id]))
        return super().response_add(request, obj, post_url_continue)


# --------------------------------------------------------------------------- components
class ComponentForm(forms.ModelForm):
    """The component secret is write-only: empty keeps it, and a new component gets a strong
    generated one; only the operator's staff read it back, in the configuration snippet."""

    new_secret = forms.CharField(
        label="Secret",
        required=False,
        strip=True,
        widget=forms.PasswordInput(
            render_value=False, attrs={"autocomplete": "new-password", "spellcheck": "false"}
        ),
        help_text="Leave empty to keep the current secret (a new component gets a strong "
        "generated one), or enter the one already set on the XMPP server: "
        + onboarding.SECRET_HELP
        + ".",
    )

    class Meta:
        model = Component
        fields = (
            "tenant",
            "app",
            "jid",
            "host",
            "port",
            "enabled",
            "unifiedpush_endpoint_url",
            "unifiedpush_token_lifetime_days",
        )

    def clean_new_secret(self) -> str:
        secret = self.cleaned_data.get("new_secret") or ""
        if secret and not onboarding.valid_secret(secret):
            raise forms.ValidationError(onboarding.SECRET_HELP)
        return secret

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        # The tenant is read-only (not in the form) for a tenant's own staff.
        tenant = cleaned.get("tenant")
        tenant_id = tenant.pk if tenant is not None else self.instance.tenant_id
        app = cleaned.get("app")
        if app is not None and tenant_id is not None and app.tenant_id != tenant_id:
            self.add_error("app", "This app belongs to another tenant.")
        # Read-only fields (operator-only) are not in the form: fall back to the instance.
        url = cleaned.get("unifiedpush_endpoint_url", self.instance.unifiedpush_endpoint_url)
        if url:
            try:
                validate_unifiedpush_url(url)
            except forms.ValidationError as error:
                self.add_error("unifiedpush_endpoint_url", error)
        has_app = app is not None if "app" in self.fields else self.instance.app_id is not None
        if not has_app and not url:
            raise forms.ValidationError(
                "Choose an app (the p2 commands), enter a UnifiedPush endpoint URL, or both."
            )
        return cleaned

    def save(self, commit: bool = True) -> Component:
        component = super().save(commit=False)
        secret = self.cleaned_data.get("new_secret") or ""
        if secret:
            component.secret = secret
        elif not component.secret:
            component.secret = onboarding.new_component_secret()
        if commit:
            component.save()
        return component


@admin.register(Component)
class ComponentAdmin(TenantScopedAdmin):
    form = ComponentForm
    list_display = (
        "jid",
        "tenant",
        "app",
        "enabled",
        "link_state",
        "link_since",
        "link_error",
        "pushes_last_hour",
    )
    list_filter = ("enabled", "link__state", "tenant", "app")
    search_fields = ("jid", "host")
    list_select_related = ("tenant", "app", "link", "lease")
    readonly_fields = ("link_status", "configuration")
    actions = ("enable", "disable", "regenerate_secret")
    # Where the gateway connects, and under which JID, is the operator's to decide: a tenant
    # could otherwise point the gateway at any host and port, or claim another server's JID.
    operator_only_fields = ("tenant", "jid", "host", "port", "unifiedpush_endpoint_url")
    operator_only_actions = ("regenerate_secret", "delete_selected")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return _is_operator(request) and super().has_add_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Component | None = None) -> bool:
        return _is_operator(request) and super().has_delete_permission(request, obj)

    def get_list_display(self, request: HttpRequest) -> Any:
        # Which gateway (host) holds a link is the operator's business, not a tenant's.
        shown = super().get_list_display(request)
        if _is_operator(request):
            shown = (*shown[:5], "link_gateway", *shown[5:])
        return shown

    def get_fieldsets(self, request: HttpRequest, obj: Component | None = None) -> list[Any]:
        fieldsets: list[Any] = [
            (None, {"fields": ("tenant", "app", "jid", "enabled")}),
            (
                "UnifiedPush",
                {
                    "fields": ("unifiedpush_endpoint_url", "unifiedpush_token_lifetime_days"),
                    "description": "Phones (Conversations as UnifiedPush distributor) register "
                    "here for endpoints that apps' servers POST to; the web process serves "
                    "them at <endpoint URL>/push/…. Leave the URL empty to serve only the p2 "
                    "commands.",
                },
            ),
            (
                "Connection",
                {
                    "fields": (("host", "port"), "new_secret"),
                    "description": "The relay's gateway connects to host:port of the "
                    "tenant's XMPP server as this component (XEP-0114). Changes are picked "
                    "up within seconds, without a restart.",
                },
            ),
        ]
        if obj is not None:
            fieldsets += [
                ("Link", {"fields": ("link_status",)}),
                ("Configuration for the XMPP server", {"fields": ("configuration",)}),
            ]
        return fieldsets

    def get_queryset(self, request: HttpRequest) -> QuerySet[Component]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                pushes=_count_subquery(
                    _pushes_since(1).filter(registration__isnull=False),
                    "registration__component",
                )
            )
        )

    @admin.display(description="link", ordering="link__state")
    def link_state(self, obj: Component) -> SafeString:
        return link_badge(_link_state(obj))

    @admin.display(description="since", ordering="link__since")
    def link_since(self, obj: Component) -> Any:
        link = getattr(obj, "link", None)
        return link.since if link is not None else None

    @admin.display(description="gateway", ordering="lease__holder")
    def link_gateway(self, obj: Component) -> str:
        return link_leases.holder_of(getattr(obj, "lease", None)) or "-"

    @admin.display(description="last error")
    def link_error(self, obj: Component) -> str:
        link = getattr(obj, "link", None)
        return link.last_error if link is not None else ""

    @admin.display(description="pushes in the last hour", ordering="pushes")
    def pushes_last_hour(self, obj: Component) -> int:
        return getattr(obj, "pushes", 0)

    @admin.display(description="link")
    def link_status(self, obj: Component) -> SafeString:
        return render_to_string(
            "admin/relay/link_status.html",
            {
                "state": _link_state(obj),
                "badge": link_badge(_link_state(obj)),
                "link": getattr(obj, "link", None),
                "pushes_last_hour": getattr(obj, "pushes", 0),
                "show_gateway": getattr(obj, "_show_secret", False),  # the operator's
                "gateway": link_leases.current_holder(obj.pk),
            },
        )

    @admin.display(description="paste into the server")
    def configuration(self, obj: Component) -> SafeString:
        # The request is not passed to display functions; the view stores who is looking.
        show_secret = getattr(obj, "_show_secret", False)
        snippets = onboarding.config_snippets(component=obj, show_secret=show_secret)
        return render_to_string(
            "admin/relay/configuration.html",
            {"snippets": snippets, "show_secret": show_secret, "component": obj},
        )

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Component | None:
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            obj._show_secret = _is_operator(request)
        return obj

    def response_add(
        self, request: HttpRequest, obj: Component, post_url_continue: str | None = None
    ) -> HttpResponse:
        # Straight to the component's page: its configuration snippet is the next step.
        if not {"_addanother", "_popup"} & set(request.POST):
            messages.success(
                request,
                "Paste the configuration below into the tenant's XMPP server; the link comes "
                "up within seconds once the server knows the component.",
            )
            return HttpResponseRedirect(reverse("admin:relay_component_change", args=[obj.pk]))
        return super().response_add(request, obj, post_url_continue)

    @admin.action(description="Enable the selected components", permissions=["change"])
    def enable(self, request: HttpRequest, queryset: QuerySet[Component]) -> None:
        changed = 0
        for component in queryset.filter(enabled=False):
            component.enabled = True
            component.save(update_fields=["enabled", "updated"])
            self.log_change(request, component, change_message(Component, "enabled"))
            changed += 1
        self.message_user(request, f"Enabled {changed} component(s).", messages.SUCCESS)

    @admin.action(description="Disable the selected components", permissions=["change"])
    def disable(self, request: HttpRequest, queryset: QuerySet[Component]) -> HttpResponse | None:
        page = confirm(
            self,
            request,
            queryset,
            action="disable",
            title="Disable these components?",
            consequence="The gateway closes their links within seconds. Prosody answers "
            "publishes with a temporary error meanwhile; ejabberd may drop its users' "
            "registrations.",
        )
        if page is not None:
            return page
        changed = 0
        for component in queryset.filter(enabled=True):
            component.enabled = False
            component.save(update_fields=["enabled", "updated"])
            self.log_change(request, component, change_message(Component, "enabled"))
            changed += 1
        self.message_user(request, f"Disabled {changed} component(s).", messages.SUCCESS)
        return None

    @admin.action(description="Generate new secrets", permissions=["operator"])
    def regenerate_secret(
        self, request: HttpRequest, queryset: QuerySet[Component]
    ) -> HttpResponse | None:
        page = confirm(
            self,
            request,
            queryset,
            action="regenerate_secret",
            title="Generate new secrets for these components?",
            consequence="Their links fail until each XMPP server is given its new secret "
            "(shown in the component's configuration snippet).",
        )
        if page is not None:
            return page
        for component in queryset:
            component.secret = onboarding.new_component_secret()
            component.save(update_fields=["secret", "updated"])
            self.log_change(request, component, change_message(Component, "secret"))
        self.message_user(request, f"Generated {queryset.count()} new secret(s).", messages.SUCCESS)
        return None


# --------------------------------------------------------------------------- registrations
class RegistrationStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("alive", "alive"), ("dead", "token gone")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "alive":
            return queryset.filter(dead_since__isnull=True)
        if self.value() == "dead":
            return queryset.filter(dead_since__isnull=False)
        return queryset


@admin.register(Registration)
class RegistrationAdmin(TenantScopedAdmin):
    list_display = (
        "node",
        "service",
        "account_domain",
        "app",
        "component",
        "created",
        "last_push",
        "dead_since",
    )
    list_filter = ("service", RegistrationStateFilter, "app__tenant", "app", "component")
    list_select_related = ("app", "app__tenant", "component")
    # Exact node, or the account's domain: there is no JID to search by.
    search_fields = ("=node", "account_domain")
    search_help_text = "A node (exact) or an account domain."
    fields = (
        "app",
        "component",
        "service",
        "node",
        "account_domain",
        "device_hash",
        "room_hash",
        "created",
        "updated",
        "last_push",
        "dead_since",
        "recent_deliveries",
    )
    readonly_fields = fields
    actions = ("test_push",)
    change_form_template = "admin/relay/registration/change_form.html"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # Nothing here is editable: the change permission is for the test push.
        extra_context = {**(extra_context or {}), "show_save": False}
        extra_context["show_save_and_continue"] = False
        return super().change_view(request, object_id, form_url, extra_context)

    def get_urls(self) -> list[Any]:
        return [
            path(
                "<path:object_id>/test-push/",
                self.admin_site.admin_view(self.test_push_view),
                name="relay_registration_test_push",
            ),
            *super().get_urls(),
        ]

    @admin.display(description="recent deliveries")
    def recent_deliveries(self, obj: Registration) -> SafeString:
        return render_to_string(
            "admin/relay/recent_deliveries.html",
            {
                "deliveries": obj.deliveries.order_by("-received")[:20],
                "log_url": reverse("admin:relay_delivery_changelist")
                + f"?registration__id__exact={obj.pk}",
            },
        )

    def _queue_test_push(self, request: HttpRequest, registration: Registration) -> bool:
        try:
            job = send_test_push(registration=registration)
        except QueueUnavailable:
            self.message_user(
                request, "The queue is unavailable: no test push was sent.", messages.ERROR
            )
            return False
        self.log_change(request, registration, f"Sent a test push ({job.push_id}).")
        return True

    def test_push_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if request.method != "POST":
            return HttpResponseRedirect(
                reverse("admin:relay_registration_change", args=[object_id])
            )
        registration = self.get_object_or_404(request, object_id)
        if not self.has_change_permission(request, registration):
            raise PermissionDenied
        if self._queue_test_push(request, registration):
            self.message_user(
                request,
                format_html(
                    'Test push queued; its outcome appears in the <a href="{}">delivery log</a>.',
                    reverse("admin:relay_delivery_changelist")
                    + f"?registration__id__exact={registration.pk}",
                ),
                messages.SUCCESS,
            )
        return HttpResponseRedirect(
            reverse("admin:relay_registration_change", args=[registration.pk])
        )

    @admin.action(description="Send a test push", permissions=["change"])
    def test_push(self, request: HttpRequest, queryset: QuerySet[Registration]) -> None:
        sent = sum(1 for registration in queryset if self._queue_test_push(request, registration))
        if sent:
            self.message_user(request, f"Queued {sent} test push(es).", messages.SUCCESS)


# --------------------------------------------------------------------------- deliveries
class CsvEcho:
    """A file-like sink for csv.writer that hands each row straight to the response."""

    def write(self, value: str) -> str:
        return value


def csv_response(
    name: str, header: Sequence[str], rows: Iterable[Sequence[Any]]
) -> StreamingHttpResponse:
    writer = csv.writer(CsvEcho())

    def generate() -> Iterable[str]:
        yield writer.writerow(header)
        for row in rows:
            yield writer.writerow(row)

    response = StreamingHttpResponse(generate(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


@admin.display(description="provider", ordering="provider")
def provider_code(obj: Delivery | DeadLetter) -> str:
    """The short code (fcm, apns, wns): the full names make the log's columns wrap."""
    return obj.provider


@admin.register(UnifiedPushDelivery)
class UnifiedPushDeliveryAdmin(TenantScopedAdmin):
    """One row per UnifiedPush message and how it ended; no JID, no body, no endpoint."""

    list_display = ("received", "component", "outcome", "urgency", "size", "ttl", "attempts",
                    "finished")  # fmt: skip
    list_filter = (
        "outcome",
        ("received", admin.DateFieldListFilter),
        "tenant",
        "component",
        "urgency",
    )
    list_select_related = ("component",)
    date_hierarchy = "received"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Delivery)
class DeliveryAdmin(TenantScopedAdmin):
    list_display = (
        "received",
        "app",
        provider_code,
        "priority",
        "outcome",
        "error_code",
        "attempts",
        "registration_link",
    )
    list_filter = (
        "outcome",
        "provider",
        ("received", admin.DateFieldListFilter),
        "tenant",
        "app",
        "priority",
    )
    list_select_related = ("tenant", "app", "registration")
    search_fields = ("=push_id", "publishing_domain", "=registration__node")
    search_help_text = "A push id, a publishing domain or a node (exact)."
    date_hierarchy = "received"
    # A registration's page links to its deliveries.
    extra_lookup_fields = ("registration",)
    actions = ("export_csv",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="registration", ordering="registration__node")
    def registration_link(self, obj: Delivery) -> SafeString | str:
        if obj.registration is None:
            return "—"
        return format_html(
            '<a href="{}">{}</a>',
            reverse("admin:relay_registration_change", args=[obj.registration_id]),
            obj.registration.node,
        )

    @admin.action(description="Export the selected deliveries as CSV", permissions=["view"])
    def export_csv(self, request: HttpRequest, queryset: QuerySet[Delivery]) -> HttpResponse:
        header = (
            "push_id",
            "tenant",
            "app",
            "provider",
            "priority",
            "publishing_domain",
            "received",
            "queued",
            "sent",
            "attempts",
            "outcome",
            "error_code",
        )
        rows = (
            (
                row.push_id,
                row.tenant.name,
                row.app.name,
                row.provider,
                row.priority,
                row.publishing_domain,
                row.received.isoformat(),
                row.queued.isoformat(),
                row.sent.isoformat() if row.sent else "",
                row.attempts,
                row.outcome,
                row.error_code,
            )
            for row in queryset.select_related("tenant", "app").iterator()
        )
        return csv_response("deliveries.csv", header, rows)


# --------------------------------------------------------------------------- dead letters
@admin.register(DeadLetter)
class DeadLetterAdmin(TenantScopedAdmin):
    list_display = ("created", "app", provider_code, "reason", "attempts", "replayed")
    list_filter = (
        "provider",
        "reason",
        ("created", admin.DateFieldListFilter),
        ("replayed", admin.EmptyFieldListFilter),
        "tenant",
        "app",
    )
    list_select_related = ("tenant", "app")
    search_fields = ("=push_id", "=registration__node")
    search_help_text = "A push id or a node (exact)."
    date_hierarchy = "created"
    readonly_fields = (
        "push_id",
        "tenant",
        "app",
        "registration",
        "provider",
        "reason",
        "attempts",
        "job",
        "created",
        "replayed",
    )
    actions = ("replay",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Replay the selected dead letters", permissions=["change"])
    def replay(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        """Queue them again (same push id); each replay is recorded in the history."""
        pending = list(queryset.filter(replayed__isnull=True))
        try:
            replayed = dead_letters.replay(dead_letter_ids=[letter.pk for letter in pending])
        except QueueUnavailable:
            self.message_user(
                request, "The queue is unavailable: not everything was replayed.", messages.ERROR
            )
            replayed = None
        for letter in DeadLetter.objects.filter(
            pk__in=[letter.pk for letter in pending], replayed__isnull=False
        ):
            self.log_change(request, letter, "Replayed.")
        if replayed is not None:
            skipped = queryset.count() - replayed
            note = f" ({skipped} already replayed)" if skipped else ""
            self.message_user(
                request, f"Replayed {replayed} dead letter(s){note}.", messages.SUCCESS
            )


# --------------------------------------------------------------------------- operator-only
@admin.register(TenantStaffGroup)
class TenantStaffGroupAdmin(OperatorOnlyAdmin):
    list_display = ("group", "tenant", "created")
    list_filter = ("tenant",)
    search_fields = ("group__name", "tenant__name")
    autocomplete_fields = ("group",)


@admin.register(LogEntry)
class AuditLogAdmin(OperatorOnlyAdmin):
    """Who changed what, when: every admin change, credentials included (names, not values)."""

    list_display = ("action_time", "user", "content_type", "object_repr", "action", "message")
    list_filter = ("action_flag", "content_type", "user")
    search_fields = ("object_repr", "user__username")
    date_hierarchy = "action_time"
    list_select_related = ("user", "content_type")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="action", ordering="action_flag")
    def action(self, obj: LogEntry) -> str:
        return {1: "added", 2: "changed", 3: "deleted"}.get(obj.action_flag, "?")

    @admin.display(description="change")
    def message(self, obj: LogEntry) -> str:
        return obj.get_change_message()


admin.site.unregister(User)
admin.site.unregister(Group)


@admin.register(User)
class RelayUserAdmin(OperatorOnlyAdmin, UserAdmin):
    pass


@admin.register(Group)
class RelayGroupAdmin(OperatorOnlyAdmin, GroupAdmin):
    pass
