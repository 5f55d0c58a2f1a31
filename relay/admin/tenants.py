"""The tenants' pages: a tenant with its apps, components and staff groups inline, and its usage."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db import models
from django.db.models import QuerySet
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
)
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from relay.admin.base import (
    ScopedInline,
    TenantScopedAdmin,
    annotated_count,
    change_message,
    component_link_state,
    confirm,
    count_subquery,
    is_operator_request,
    link_badge,
    pushes_since,
    usage_panel,
)
from relay.models import (
    App,
    Component,
    LinkState,
    Tenant,
    TenantStaffGroup,
)
from relay.services import tenancy
from relay.services.credentials import selectors as credential_selectors


# --------------------------------------------------------------------------- tenants
class AppInline(ScopedInline):
    model = App
    fields = ("name", "public_key", "credentials")
    readonly_fields = fields
    verbose_name_plural = "apps (their provider credentials are on each app's page)"

    @admin.display(description="credentials")
    def credentials(self, obj: App) -> str:
        return format_html_join(
            mark_safe("<br>"), "{}: {}", credential_selectors.credential_summary(app=obj)
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
                pushes=count_subquery(
                    pushes_since(1).filter(registration__isnull=False),
                    "registration__component",
                )
            )
        )

    # Not named "link": that is the reverse relation to ComponentLink, which would win.
    @admin.display(description="link")
    def link_state(self, obj: Component) -> SafeString:
        return link_badge(component_link_state(obj))

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
        return is_operator_request(request) and super().has_view_permission(request, obj)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_operator_request(request) and super().has_add_permission(request, obj)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_operator_request(request) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_operator_request(request) and super().has_delete_permission(request, obj)


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
        return is_operator_request(request) and super().has_add_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Tenant | None = None) -> bool:
        return is_operator_request(request) and super().has_delete_permission(request, obj)

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
                app_count=count_subquery(App.objects.all(), "tenant"),
                component_count=count_subquery(Component.objects.filter(enabled=True), "tenant"),
                up_count=count_subquery(
                    Component.objects.filter(enabled=True, link__state=LinkState.UP), "tenant"
                ),
                day_count=count_subquery(pushes_since(24), "tenant"),
            )
        )

    @admin.display(description="status", ordering="suspended")
    def status(self, obj: Tenant) -> SafeString:
        if obj.suspended:
            return format_html('<strong style="color:#c62828">{}</strong>', "suspended")
        return mark_safe("active")

    @admin.display(description="apps", ordering="app_count")
    def apps(self, obj: Tenant) -> int:
        return annotated_count(obj, "app_count")

    @admin.display(description="links up")
    def links_up(self, obj: Tenant) -> str:
        return f"{annotated_count(obj, 'up_count')} / {annotated_count(obj, 'component_count')}"

    @admin.display(description="pushes, last 24 h", ordering="day_count")
    def pushes_day(self, obj: Tenant) -> int:
        return annotated_count(obj, "day_count")

    @admin.display(description="next steps")
    def onboarding(self, obj: Tenant) -> SafeString:
        apps = list(obj.apps.all())
        components = list(obj.components.select_related("link"))
        up = sum(1 for component in components if component_link_state(component) == LinkState.UP)
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
