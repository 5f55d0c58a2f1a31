"""The delivery records and dead letters: read-only lists, CSV exports, and the replay of
dead letters.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import (
    HttpRequest,
    StreamingHttpResponse,
)
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from relay.admin.base import (
    ReadOnlyAdmin,
    TenantScopedAdmin,
)
from relay.models import (
    DeadLetter,
    Delivery,
)
from relay.services import dead_letters
from relay.services.queue import QueueUnavailable


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


@admin.register(Delivery)
class DeliveryAdmin(ReadOnlyAdmin, TenantScopedAdmin):
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
    def export_csv(
        self, request: HttpRequest, queryset: QuerySet[Delivery]
    ) -> StreamingHttpResponse:
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
