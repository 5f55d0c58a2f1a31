from django.apps import AppConfig


class OperatorsConfig(AppConfig):
    """Second factor, audit trail and session limits for the admin's staff."""

    name = "relay.operators"
    label = "operators"
    verbose_name = "Operators' security"
    # What it adds to the site (relay.features): the second step's pages under admin/.
    urlpatterns = "relay.operators.urls.site_urlpatterns"

    def ready(self) -> None:
        from relay.operators import receivers  # noqa: F401 -- connects the audit receivers
        from relay.operators.models import AuditEntry, TenantSecurityPolicy
        from relay.services import retention, tenancy

        tenancy.register_tenant_owned(AuditEntry, "tenant", staff_permissions=["view_auditentry"])
        tenancy.register_tenant_owned(TenantSecurityPolicy, "tenant")
        retention.register_pruned(AuditEntry, "at")
