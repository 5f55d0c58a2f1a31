"""The UnifiedPush delivery records: read-only, as the other delivery records."""

from __future__ import annotations

from django.contrib import admin

from relay.admin.base import (
    ReadOnlyAdmin,
    TenantScopedAdmin,
)
from relay.unifiedpush.models import UnifiedPushDelivery


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
