"""UnifiedPush in the admin: its settings on a component's page, the delivery records
(read-only, as the other delivery records) and its daily report (read-only, the operator's, as
the other report aggregates)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from relay.admin.base import (
    ReadOnlyAdmin,
    TenantScopedAdmin,
    is_operator_request,
)
from relay.admin.components import ComponentPartFormSet
from relay.admin.reports import ReportAdmin
from relay.forms import HttpsURLField
from relay.models import Component
from relay.unifiedpush.models import ComponentSettings, ReportUnifiedPush, UnifiedPushDelivery


class ComponentSettingsForm(forms.ModelForm):
    class Meta:
        model = ComponentSettings
        fields = ("endpoint_url", "token_lifetime_days")
        field_classes = {"endpoint_url": HttpsURLField}
        help_texts = {
            "endpoint_url": "Public base URL of this relay's web process (or its reverse "
            "proxy), e.g. https://push.example.org. Phones (Conversations as UnifiedPush "
            "distributor) register here for endpoints that apps' servers POST to; the web "
            "process serves them at <endpoint URL>/push/…. Leave it empty (or delete it) to "
            "serve only the p2 commands."
        }


class ComponentSettingsInline(admin.StackedInline):
    """On the component's page (relay.features: component_inlines). They are the
    component's settings: whoever may see or change the component may see or change them;
    turning UnifiedPush on or off, and where its endpoints are, are the operator's."""

    model = ComponentSettings
    form = ComponentSettingsForm
    formset = ComponentPartFormSet
    fields = ("endpoint_url", "token_lifetime_days")
    extra = 1
    max_num = 1
    verbose_name = "UnifiedPush"
    verbose_name_plural = "UnifiedPush"

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = list(super().get_readonly_fields(request, obj))
        if not is_operator_request(request):
            fields.append("endpoint_url")
        return fields

    def _component_permission(self, request: HttpRequest, action: str) -> bool:
        return bool(request.user.has_perm(f"relay.{action}_component"))

    def has_view_permission(self, request: HttpRequest, obj: Component | None = None) -> bool:
        return self._component_permission(request, "view") or self._component_permission(
            request, "change"
        )

    def has_change_permission(self, request: HttpRequest, obj: Component | None = None) -> bool:
        return self._component_permission(request, "change")

    def has_add_permission(self, request: HttpRequest, obj: Component | None = None) -> bool:
        return is_operator_request(request) and self._component_permission(request, "change")

    def has_delete_permission(self, request: HttpRequest, obj: Component | None = None) -> bool:
        return is_operator_request(request) and self._component_permission(request, "change")


@admin.register(UnifiedPushDelivery)
class UnifiedPushDeliveryAdmin(ReadOnlyAdmin, TenantScopedAdmin):
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


@admin.register(ReportUnifiedPush)
class ReportUnifiedPushAdmin(ReportAdmin):
    list_display = (
        "day",
        "tenant_name",
        "component_name",
        "received",
        "delivered",
        "expired",
        "revoked",
        "replaced",
        "withdrawn",
        "dropped",
        "bytes_relayed",
    )
    search_fields = ("tenant_name", "component_name")
