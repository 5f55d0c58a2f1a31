from django.apps import AppConfig


class UnifiedPushConfig(AppConfig):
    """UnifiedPush over XMPP: its models, admin, push resource, services and gateway part."""

    name = "relay.unifiedpush"
    label = "unifiedpush"
    verbose_name = "UnifiedPush"
    # What the gateway plugs in (xmppgateway.features): the register iq, relaying stored
    # messages, the direct path's listener.
    gateway_feature = "relay.unifiedpush.gateway.relay.UnifiedPushRelay"
    # What it adds to the core (relay.features): its settings of a component (load_tenants'
    # `unifiedpush` section, the snippet on the component's page) and their admin inline.
    component_part = "relay.unifiedpush.component.part"
    component_inlines = ("relay.unifiedpush.admin.ComponentSettingsInline",)
    # The web process serves its endpoints, message resources and Matrix push gateway on its
    # event loop (pushsite/server.py).
    web_resources = ("relay.unifiedpush.http.PushResource",)
    # The same paths in Django's URLs, for `manage.py runserver` (the web process answers
    # them before Django).
    urlpatterns = "relay.unifiedpush.urls.urlpatterns"
    # Its gauges of /metrics (the messages waiting for phones).
    state_metrics = ("relay.unifiedpush.metrics.state",)
    # Its chart on the admin's reports page.
    report_charts = ("relay.unifiedpush.reports.chart",)

    def ready(self) -> None:
        from relay.services import retention, tenancy
        from relay.unifiedpush import checks  # noqa: F401 -- registers the system checks
        from relay.unifiedpush.models import UnifiedPushDelivery

        tenancy.register_tenant_owned(
            UnifiedPushDelivery, "tenant", staff_permissions=["view_unifiedpushdelivery"]
        )
        # Its delivery records are a source of the reports: RELAY_RETENTION_DAYS prunes them.
        retention.register_pruned(UnifiedPushDelivery, "received")
