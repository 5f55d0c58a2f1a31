"""The operator's own pages: staff groups of tenants, the audit log, users and groups."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User

from relay.admin.base import (
    OperatorOnlyAdmin,
    ReadOnlyAdmin,
)
from relay.models import (
    TenantStaffGroup,
)


# --------------------------------------------------------------------------- operator-only
@admin.register(TenantStaffGroup)
class TenantStaffGroupAdmin(OperatorOnlyAdmin):
    list_display = ("group", "tenant", "created")
    list_filter = ("tenant",)
    search_fields = ("group__name", "tenant__name")
    autocomplete_fields = ("group",)


@admin.register(LogEntry)
class AuditLogAdmin(ReadOnlyAdmin, OperatorOnlyAdmin):
    """Who changed what, when: every admin change, credentials included (names, not values)."""

    list_display = ("action_time", "user", "content_type", "object_repr", "action", "message")
    list_filter = ("action_flag", "content_type", "user")
    search_fields = ("object_repr", "user__username")
    date_hierarchy = "action_time"
    list_select_related = ("user", "content_type")

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
