"""UnifiedPush's chart on the admin's reports page (relay.features: `report_charts`)."""

from __future__ import annotations

from collections.abc import Collection

from relay.admin_charts import daily_chart
from relay.services import report_data

# The provider value of UnifiedPush messages in the reports (analytics.schema.UNIFIEDPUSH).
PROVIDER = "up"


class MessagesChart:
    """UnifiedPush messages per day, as the pushes' chart beside it."""

    title = "UnifiedPush messages per reported day, last 30 days"
    element_id = "report-unifiedpush-chart"

    def render(self, tenant_ids: Collection[int] | None) -> str:
        return daily_chart(
            report_data.daily_usage(tenant_ids=tenant_ids, provider=PROVIDER),
            title="UnifiedPush messages per reported day",
        )


chart = MessagesChart()
