from django.apps import AppConfig


class RelayConfig(AppConfig):
    name = "relay"
    verbose_name = "Push relay"

    def ready(self) -> None:
        # Importing them registers the system checks and connects the signal receivers.
        from relay import checks, receivers, report_checks  # noqa: F401
