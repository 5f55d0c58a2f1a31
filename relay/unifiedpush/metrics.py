"""UnifiedPush's gauges of /metrics (relay.features: `state_metrics`), read from the database
when the web process is scraped, as the core's (relay/services/observability.py)."""

from __future__ import annotations

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily, Metric

from relay.models import Tenant
from relay.unifiedpush.models import UnifiedPushMessage


class StoredMessages:
    """Messages waiting in the store for their phone, by tenant: a store that only grows
    means phones that never come back, or a gateway that does not send."""

    names = ("relay_unifiedpush_stored_messages",)

    def read(self) -> list[Metric]:
        family = GaugeMetricFamily(
            self.names[0],
            "UnifiedPush messages stored for a phone that has not taken them yet, by tenant.",
            labels=["tenant"],
        )
        tenants = dict(Tenant.objects.values_list("pk", "name"))
        rows = UnifiedPushMessage.objects.values("tenant_id").annotate(n=Count("pk"))
        for row in rows.order_by():
            family.add_metric([tenants.get(row["tenant_id"], "")], row["n"])
        return [family]


state = StoredMessages()
