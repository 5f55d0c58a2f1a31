"""The admin's reports: a page of charts and tables from the daily aggregates the Spark
jobs load, and the aggregates themselves, read-only.

The page is scoped with `relay.services.tenancy`: the operator's staff see every tenant and
the totals, a tenant's own staff only their tenant's figures. The aggregate tables themselves
are the operator's (read-only). Charts are the admin's inline SVG (no asset
from elsewhere).
"""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path

from relay import features
from relay.admin.base import OperatorOnlyAdmin, ReadOnlyAdmin
from relay.admin_charts import daily_chart
from relay.report_models import (
    ReportAnomaly,
    ReportDomain,
    ReportErrorCode,
    ReportRegistrations,
    ReportUsage,
)
from relay.services import report_data, tenancy


def reports_view(site: admin.AdminSite, request: HttpRequest) -> TemplateResponse:
    """Pushes per day, latency, registrations, top domains, error codes and anomalies."""
    tenant_ids = tenancy.tenant_ids_for(request.user)
    registrations_day, registrations = report_data.latest_registrations(tenant_ids=tenant_ids)
    domains_day, domains = report_data.top_domains(tenant_ids=tenant_ids)
    context = {
        **site.each_context(request),
        "title": "Reports",
        "chart": daily_chart(
            report_data.daily_usage(tenant_ids=tenant_ids), title="Pushes per reported day"
        ),
        "feature_charts": [
            (chart.title, chart.element_id, chart.render(tenant_ids))
            for chart in features.report_charts()
        ],
        "latency": report_data.latency(tenant_ids=tenant_ids),
        "tenants": report_data.usage_per_tenant(tenant_ids=tenant_ids),
        "providers": report_data.usage_per_provider(tenant_ids=tenant_ids),
        "registrations_day": registrations_day,
        "registrations": registrations,
        "domains_day": domains_day,
        "domains": domains,
        "error_codes": report_data.error_codes(tenant_ids=tenant_ids),
        "anomalies": report_data.anomalies(tenant_ids=tenant_ids),
    }
    return TemplateResponse(request, "admin/relay/reports.html", context)


def urls(site: admin.AdminSite) -> list[URLPattern]:
    return [
        path(
            "reports/",
            site.admin_view(lambda request: reports_view(site, request)),
            name="reports",
        )
    ]


class ReportAdmin(ReadOnlyAdmin, OperatorOnlyAdmin):
    """The raw aggregates, read-only, for the operator's staff (they hold every tenant's
    figures and the totals); a tenant's own staff see theirs on the reports page."""

    list_per_page = 100
    date_hierarchy = "day"


@admin.register(ReportUsage)
class ReportUsageAdmin(ReportAdmin):
    list_display = (
        "day",
        "level",
        "tenant_name",
        "app_name",
        "provider",
        "publishes_received",
        "pushes_sent",
        "delivered",
        "dead_tokens",
        "failed",
        "bytes_relayed",
        "success_rate",
        "latency_p50_ms",
        "latency_p95_ms",
        "latency_p99_ms",
    )
    list_filter = ("level", "provider")
    search_fields = ("tenant_name", "app_name")


@admin.register(ReportRegistrations)
class ReportRegistrationsAdmin(ReportAdmin):
    list_display = (
        "day",
        "tenant_name",
        "app_name",
        "provider",
        "active",
        "new",
        "renewed",
        "died",
        "removed",
    )
    list_filter = ("provider",)


@admin.register(ReportDomain)
class ReportDomainAdmin(ReportAdmin):
    list_display = (
        "day",
        "tenant_name",
        "publishing_domain",
        "publishes_received",
        "pushes_sent",
        "failed",
        "failure_rate",
        "rank_by_volume",
        "rank_by_failure_rate",
    )
    search_fields = ("publishing_domain",)


@admin.register(ReportErrorCode)
class ReportErrorCodeAdmin(ReportAdmin):
    list_display = ("day", "tenant_name", "app_name", "provider", "outcome", "error_code", "count")
    list_filter = ("provider", "outcome")


@admin.register(ReportAnomaly)
class ReportAnomalyAdmin(ReportAdmin):
    list_display = ("day", "scope", "tenant_name", "app_name", "publishing_domain", "detail")
    list_filter = ("scope", "metric")
