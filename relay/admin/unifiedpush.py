"""The UnifiedPush delivery records: read-only, as the other delivery records."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import (
    HttpRequest,
)

from relay.admin.base import (
    TenantScopedAdmin,
)
from relay.models import (
    UnifiedPushDelivery,
)


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
