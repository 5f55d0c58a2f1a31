"""The operators' admin site: the login's lockout page, and the health and usage pages.

Everything a page shows is scoped by `relay.services.tenancy`: a tenant's own staff see their
tenant's links and numbers only, the operator's staff see all of it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, URLResolver, path, reverse

from relay.admin_charts import daily_chart
from relay.services import link_leases, login_throttle, tenancy, usage

log = logging.getLogger(__name__)


def locked_out(
    request: HttpRequest, original_response: HttpResponse | None = None, credentials: Any = None
) -> HttpResponse:
    """The page django-axes answers a locked-out login with (429), in the admin's look."""
    minutes = math.ceil(login_throttle.cool_off(request).total_seconds() / 60)
    log.warning("admin.login_locked_out")
    context = {
        **admin.site.each_context(request),
        "title": "Too many failed login attempts",
        "minutes": minutes,
        "login_url": reverse("admin:login"),
    }
    response = TemplateResponse(request, "admin/relay/locked_out.html", context, status=429)
    response["Retry-After"] = str(minutes * 60)
    return response.render()


class RelayAdminSite(admin.AdminSite):
    site_header = "Push relay"
    site_title = "Push relay admin"
    index_title = "Tenants, links and pushes"
    index_template = "admin/relay/index.html"
    site_url = None  # the service has no public site to go back to

    def get_urls(self) -> list[URLResolver | URLPattern]:
        # Imported here: it registers the report pages and their models.
        from relay.admin import reports as admin_reports

        extra = [
            *admin_reports.urls(self),
            path("health/", self.admin_view(self.health_view), name="health"),
            path("usage/", self.admin_view(self.usage_view), name="usage"),
        ]
        return extra + super().get_urls()

    def health_view(self, request: HttpRequest) -> TemplateResponse:
        """Links, queue depth and provider error rates at a glance (scoped to the user)."""
        tenant_ids = tenancy.tenant_ids_for(request.user)
        operator = tenant_ids is None
        context = {
            **self.each_context(request),
            "title": "Health",
            "links": usage.link_overview(tenant_ids=tenant_ids),
            "rates": usage.provider_rates(tenant_ids=tenant_ids),
            "dead_letters": usage.dead_letters_waiting(tenant_ids=tenant_ids),
            "operator": operator,
            # The shared queue is the operator's business, not one tenant's.
            "queue_depth": usage.queue_depth() if operator else None,
            # Which hosts run gateways is the operator's business too.
            "gateways": link_leases.live_gateways() if operator else None,
        }
        return TemplateResponse(request, "admin/relay/health.html", context)

    def usage_view(self, request: HttpRequest) -> TemplateResponse:
        """Pushes per tenant, app and provider over the last day and 30 days."""
        tenant_ids = tenancy.tenant_ids_for(request.user)
        rows = usage.usage_table(tenant_ids=tenant_ids)
        day, month = usage.totals(rows)
        context = {
            **self.each_context(request),
            "title": "Usage",
            "rows": rows,
            "day_total": day,
            "month_total": month,
            "chart": daily_chart(usage.daily_counts(tenant_ids=tenant_ids)),
        }
        return TemplateResponse(request, "admin/relay/usage.html", context)
