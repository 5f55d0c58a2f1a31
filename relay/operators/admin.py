"""The audit trail's pages (operators see all of it, a tenant's staff their tenant's; CSV
export), tenants' security policies (operators only), and the operator's actions on a staff
member: end their sessions, reset their second factor.

django-otp's own device pages are removed: they would show an operator every TOTP secret.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.auth.models import User
from django.db.models import QuerySet
from django.http import HttpRequest, StreamingHttpResponse
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from relay.admin.base import OperatorOnlyAdmin, ReadOnlyAdmin, TenantScopedAdmin
from relay.admin.deliveries import csv_response
from relay.admin.staff import RelayUserAdmin
from relay.operators.models import AuditEntry, TenantSecurityPolicy
from relay.operators.services import second_factor, sessions

for _model in (TOTPDevice, StaticDevice):
    if admin.site.is_registered(_model):
        admin.site.unregister(_model)


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin, TenantScopedAdmin):
    """Who changed what and when, from where: field names, never values."""

    list_display = (
        "at",
        "actor",
        "address",
        "action",
        "object_type",
        "object_repr",
        "changed_fields",
        "detail",
    )
    list_filter = ("action", "object_type", ("at", admin.DateFieldListFilter), "tenant")
    search_fields = ("actor", "object_repr", "=address")
    search_help_text = "A user or command, an object's name, or an address (exact)."
    date_hierarchy = "at"
    actions = ("export_csv",)

    @admin.display(description="fields")
    def changed_fields(self, obj: AuditEntry) -> str:
        return ", ".join(obj.fields)

    @admin.action(description="Export the selected audit entries as CSV", permissions=["view"])
    def export_csv(
        self, request: HttpRequest, queryset: QuerySet[AuditEntry]
    ) -> StreamingHttpResponse:
        header = (
            "at",
            "actor",
            "user_id",
            "address",
            "action",
            "object_type",
            "object_id",
            "object",
            "fields",
            "detail",
            "tenant_id",
        )
        rows = (
            (
                row.at.isoformat(),
                row.actor,
                row.user_id or "",
                row.address,
                row.action,
                row.object_type,
                row.object_id,
                row.object_repr,
                " ".join(row.fields),
                row.detail,
                row.tenant_id or "",
            )
            for row in queryset.order_by("at", "id").iterator()
        )
        return csv_response("audit.csv", header, rows)


@admin.register(TenantSecurityPolicy)
class TenantSecurityPolicyAdmin(OperatorOnlyAdmin):
    """Operators decide whether a tenant's staff need a second factor (default: they do)."""

    list_display = ("tenant", "second_factor_required", "updated")
    list_filter = ("second_factor_required",)


admin.site.unregister(User)


@admin.register(User)
class StaffSecurityUserAdmin(RelayUserAdmin):
    """The operator's user pages, with the security actions for a staff member."""

    actions = ("end_sessions", "reset_second_factor")

    @admin.action(description="Log the selected users out everywhere", permissions=["change"])
    def end_sessions(self, request: HttpRequest, queryset: QuerySet[User]) -> None:
        for user in queryset:
            sessions.end_everywhere(
                user, keep=request, reason=f"ended by {request.user.get_username()}"
            )
        messages.success(request, f"Ended every session of {queryset.count()} user(s).")

    @admin.action(
        description="Reset the second factor of the selected users (they enrol anew)",
        permissions=["change"],
    )
    def reset_second_factor(self, request: HttpRequest, queryset: QuerySet[User]) -> None:
        removed = sum(second_factor.reset_devices(user) for user in queryset)
        for user in queryset:
            sessions.end_everywhere(user, keep=request, reason="second factor reset")
        messages.success(request, f"Removed {removed} device(s); they enrol at their next login.")
