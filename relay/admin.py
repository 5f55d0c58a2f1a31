"""The Django admin: where operators look after tenants, apps, links and registrations.

Secrets and tokens are never listed; registrations are found by node or account domain
(there is no JID to search by, and the admin must not invent one).
"""

from __future__ import annotations

from django.contrib import admin

from relay.models import App, Component, ComponentLink, Delivery, Registration, Tenant


class AppInline(admin.TabularInline):
    model = App
    fields = ("name",)
    extra = 0
    show_change_link = True


class ComponentInline(admin.TabularInline):
    model = Component
    fields = ("jid", "app", "host", "port", "enabled")
    extra = 0
    show_change_link = True


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("name", "display_name", "created")
    search_fields = ("name", "display_name")
    inlines = [AppInline, ComponentInline]


@admin.register(App)
class AppAdmin(admin.ModelAdmin):
    list_display = ("name", "tenant", "has_fcm", "updated")
    list_filter = ("tenant",)
    search_fields = ("name", "tenant__name")

    @admin.display(boolean=True, description="FCM")
    def has_fcm(self, obj: App) -> bool:
        return bool(obj.fcm_service_account)


@admin.register(Component)
class ComponentAdmin(admin.ModelAdmin):
    list_display = ("jid", "tenant", "app", "host", "port", "enabled", "link_state")
    list_filter = ("enabled", "tenant")
    search_fields = ("jid",)

    @admin.display(description="link")
    def link_state(self, obj: Component) -> str:
        link = ComponentLink.objects.filter(component=obj).first()
        return link.state if link else "unknown"


@admin.register(ComponentLink)
class ComponentLinkAdmin(admin.ModelAdmin):
    list_display = ("component", "state", "since", "last_error", "last_error_at")
    readonly_fields = ("component", "state", "since", "last_error", "last_error_at")

    def has_add_permission(self, request: object) -> bool:
        return False


@admin.register(Registration)
class RegistrationAdmin(admin.ModelAdmin):
    list_display = (
        "node",
        "service",
        "account_domain",
        "app",
        "created",
        "last_push",
        "dead_since",
    )
    list_filter = ("service", "app__tenant", "app")
    search_fields = ("=node", "account_domain")
    exclude = ("token", "secret")
    readonly_fields = (
        "app",
        "component",
        "service",
        "device_hash",
        "room_hash",
        "account_domain",
        "node",
        "created",
        "updated",
        "last_push",
    )

    def has_add_permission(self, request: object) -> bool:
        return False


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin):
    list_display = ("received", "tenant", "app", "provider", "priority", "outcome", "error_code")
    list_filter = ("outcome", "provider", "tenant", "app")
    search_fields = ("=push_id", "publishing_domain")
    date_hierarchy = "received"

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False
