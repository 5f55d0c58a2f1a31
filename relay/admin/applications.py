"""The apps' pages: an app's provider credentials (write-only), its usage and the test push."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.db.models import Min, QuerySet
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
)
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html_join
from django.utils.safestring import SafeString, mark_safe

from relay.admin.base import (
    TenantScopedAdmin,
    annotated_count,
    count_subquery,
    pushes_since,
    usage_panel,
)
from relay.forms import APP_FIELDSETS, AppForm
from relay.models import (
    App,
    Registration,
)
from relay.services.credentials import selectors as credential_selectors


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
    # Explicit: the credentials' aggregate (first_expiry) groups the rows, which drops the
    # model's default ordering, and the autocomplete's pages need a stable one.
    ordering = ("name", "pk")

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
                registration_count=count_subquery(Registration.objects.all(), "app"),
                day_count=count_subquery(pushes_since(24), "app"),
                first_expiry=Min("credentials__not_after"),
            )
            .prefetch_related("credentials")
        )

    @admin.display(description="credentials")
    def credentials(self, obj: App) -> str:
        return format_html_join(
            mark_safe("<br>"), "{}: {}", credential_selectors.credential_summary(app=obj)
        )

    @admin.display(description="certificate", ordering="first_expiry")
    def certificate_expiry(self, obj: App) -> str:
        first = credential_selectors.first_expiry(app=obj)
        not_after = first[1] if first is not None else None
        if not not_after or not credential_selectors.expiry_warning(app=obj):
            return ""
        verb = "expired" if not_after <= timezone.now() else "expires"
        return f"⚠ {verb} {not_after:%Y-%m-%d}"

    @admin.display(description="registrations", ordering="registration_count")
    def registrations(self, obj: App) -> int:
        return annotated_count(obj, "registration_count")

    @admin.display(description="pushes, last 24 h", ordering="day_count")
    def pushes_day(self, obj: App) -> int:
        return annotated_count(obj, "day_count")

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
            warning = credential_selectors.expiry_warning(app=app) if app is not None else ""
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
