from django.apps import AppConfig


class WindowsConfig(AppConfig):
    """The Windows (UWPX-style) registration API, over HTTP JSON and a TLS listener."""

    name = "relay.windows"
    label = "windows"
    verbose_name = "Windows API"

    def ready(self) -> None:
        from relay.services import tenancy
        from relay.windows.models import WnsDevice

        tenancy.register_tenant_owned(WnsDevice, "app__tenant")
