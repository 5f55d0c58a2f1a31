"""The registrations' pages: found by node or account domain, never by a JID."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
)
from django.template.loader import render_to_string
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from relay.admin.base import (
    TenantScopedAdmin,
)
from relay.models import (
    Registration,
)
from relay.services.queue import QueueUnavailable
from relay.services.test_push import send_test_push


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
