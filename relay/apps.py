from django.apps import AppConfig


class RelayConfig(AppConfig):
    name = "relay"
    verbose_name = "Push relay"

    def ready(self) -> None:
        from relay import checks, report_checks  # noqa: F401 -- registers the system checks
