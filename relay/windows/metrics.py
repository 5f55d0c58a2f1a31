"""The Windows API's gauges of /metrics (relay.features: `state_metrics`), read from the
database when the web process is scraped, as the core's (relay/services/observability.py)."""

from __future__ import annotations

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily, Metric

from relay.windows.models import WnsDevice


class Devices:
    """Windows devices registered, by tenant and app (their accounts are registrations)."""

    names = ("relay_windows_devices",)

    def read(self) -> list[Metric]:
        family = GaugeMetricFamily(
            self.names[0],
            "Windows (UWPX) devices registered over the Windows API, by tenant and app.",
            labels=["tenant", "app"],
        )
        rows = WnsDevice.objects.values("app__tenant__name", "app__name").annotate(n=Count("pk"))
        for row in rows.order_by():
            family.add_metric([row["app__tenant__name"], row["app__name"]], row["n"])
        return [family]


state = Devices()
