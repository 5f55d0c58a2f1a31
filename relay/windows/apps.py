from django.apps import AppConfig


class WindowsConfig(AppConfig):
    """The Windows (UWPX-style) registration API, over HTTP JSON and a TLS listener."""

    name = "relay.windows"
    label = "windows"
    verbose_name = "Windows API"
    # What it adds (relay.features): its URLs (the HTTP API), its beat task, its gauges, and
    # which registrations it removes itself (its devices' accounts).
    urlpatterns = "relay.windows.api.urls.urlpatterns"
    beat_schedule = "relay.windows.tasks.beat_schedule"
    state_metrics = ("relay.windows.metrics.state",)
    kept_registrations = ("relay.windows.services.housekeeping.KEPT_REGISTRATIONS",)

    def ready(self) -> None:
        from relay.services import tenancy
        from relay.windows.models import WnsDevice

        tenancy.register_tenant_owned(WnsDevice, "app__tenant")
