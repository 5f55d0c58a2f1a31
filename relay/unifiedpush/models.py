"""UnifiedPush's data: which components serve it, the messages a phone has not taken yet, the
endpoints it refused, how each message ended, and the daily report of them. No JID, endpoint
or body is stored in clear (docs/unifiedpush.md, Privacy). The message and report tables keep
the names they had in the core app (`relay_…`): the Spark reports write theirs by name."""

from __future__ import annotations

from collections.abc import Collection

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from relay.models import Component, Tenant
from relay.report_models import TenantReportRow
from relay.unifiedpush import endpoint_urls

DEFAULT_TOKEN_LIFETIME_DAYS = 7


class ComponentSettings(models.Model):
    """UnifiedPush on one component: the row says it serves UnifiedPush, and where.

    A component without one does not serve it (what the defaults were when these settings
    were columns of the component)."""

    component = models.OneToOneField(
        Component,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="unifiedpush_settings",
    )
    endpoint_url = models.URLField(
        "UnifiedPush endpoint URL",
        help_text="Public base URL of this relay's web process (or its reverse proxy), e.g. "
        "https://push.example.org; endpoints are built on it.",
    )
    token_lifetime_days = models.PositiveSmallIntegerField(
        "UnifiedPush endpoint lifetime (days)",
        default=DEFAULT_TOKEN_LIFETIME_DAYS,
        validators=[MinValueValidator(1)],
        help_text="Conversations renews an endpoint when less than a day is left.",
    )

    class Meta:
        verbose_name = "UnifiedPush"
        verbose_name_plural = "UnifiedPush"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(token_lifetime_days__gte=1),
                name="unifiedpush_lifetime_positive",
            ),
            models.CheckConstraint(
                condition=~models.Q(endpoint_url=""), name="unifiedpush_endpoint_url_given"
            ),
        ]

    def __str__(self) -> str:
        return f"UnifiedPush at {self.endpoint_url}"

    def clean_fields(self, exclude: Collection[str] | None = None) -> None:
        """The endpoint URL in ASCII (an IDN host in IDNA), or a clear error: it goes into
        headers (relay.unifiedpush.endpoint_urls)."""
        errors: dict[str, list[ValidationError]] = {}
        try:
            super().clean_fields(exclude)
        except ValidationError as error:
            errors = error.error_dict
        name = "endpoint_url"
        if self.endpoint_url and name not in errors and name not in (exclude or ()):
            try:
                self.endpoint_url = endpoint_urls.normalized(self.endpoint_url)
            except ValidationError as error:
                errors[name] = error.error_list
        if errors:
            raise ValidationError(errors)


def settings_of(component: Component) -> ComponentSettings | None:
    """The component's UnifiedPush settings, None when it does not serve UnifiedPush; no
    query when they were loaded with it (select_related, as the gateway's leases do)."""
    try:
        return component.unifiedpush_settings
    except ComponentSettings.DoesNotExist:
        return None


def serves(component: Component) -> bool:
    return settings_of(component) is not None


class UnifiedPushUrgency(models.IntegerChoices):
    """RFC 8030 Urgency, ordered: when an endpoint's storage is full, the least urgent goes."""

    VERY_LOW = 0, "very-low"
    LOW = 1, "low"
    NORMAL = 2, "normal"
    HIGH = 3, "high"


class UnifiedPushMessage(models.Model):
    """A message POSTed to an endpoint and not yet taken by the phone.

    Nothing here names the account: the routing JID, application, instance and body are in
    `sealed` (AES-GCM under UNIFIEDPUSH_KEYS); the keys are keyed hashes (HMAC) of the
    endpoint's random id, of the full JID and of the topic. The row is deleted as soon as the
    phone answers `result`, or when it expires, is replaced, withdrawn or dropped; what
    happened is then a `UnifiedPushDelivery`.
    """

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, db_index=False, related_name="+")
    component = models.ForeignKey(
        Component, on_delete=models.CASCADE, db_index=False, related_name="+"
    )
    endpoint_key = models.CharField(max_length=32)
    recipient_key = models.CharField(max_length=32)
    topic_key = models.CharField(max_length=32, blank=True, default="")
    urgency = models.SmallIntegerField(
        choices=UnifiedPushUrgency.choices, default=UnifiedPushUrgency.NORMAL
    )
    received = models.DateTimeField()
    expires = models.DateTimeField()
    endpoint_expires = models.DateTimeField(help_text="When the endpoint's token expires.")
    next_attempt = models.DateTimeField()
    attempts = models.PositiveSmallIntegerField(default=0)
    size = models.PositiveIntegerField(help_text="Body bytes as POSTed.")
    ttl = models.PositiveIntegerField(help_text="Seconds granted.")
    sealed = models.BinaryField()

    class Meta:
        db_table = "relay_unifiedpushmessage"
        # Every index costs each POST an insert and each delivery a delete: these four are
        # what the lookups need (plain btrees; db_index would add a LIKE index per key).
        indexes = [
            models.Index(fields=["endpoint_key"], name="up_message_endpoint"),
            models.Index(fields=["recipient_key"], name="up_message_recipient"),
            models.Index(fields=["component", "next_attempt"], name="up_message_due"),
            models.Index(fields=["expires"], name="up_message_expires"),
        ]

    def __str__(self) -> str:
        return f"UnifiedPush message {self.pk}"


class UnifiedPushRevocation(models.Model):
    """An endpoint the phone refused (`item-not-found`): its POSTs answer 404 until it expires."""

    endpoint_key = models.CharField(max_length=32, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    created = models.DateTimeField(auto_now_add=True)
    expires = models.DateTimeField(db_index=True)

    class Meta:
        db_table = "relay_unifiedpushrevocation"

    def __str__(self) -> str:
        return f"revoked endpoint {self.endpoint_key[:8]}"


class UnifiedPushOutcome(models.TextChoices):
    DELIVERED = "delivered", "delivered (the phone answered result)"
    EXPIRED = "expired", "expired (TTL passed before the phone took it)"
    REVOKED = "revoked", "revoked (the phone said item-not-found)"
    REPLACED = "replaced", "replaced (a newer message with the same Topic)"
    WITHDRAWN = "withdrawn", "withdrawn (DELETE by the application server)"
    DROPPED = "dropped", "dropped (the endpoint's storage was full)"


class UnifiedPushDelivery(models.Model):
    """One UnifiedPush message as it went through us, for reports: no JID, no body, no token."""

    # (tenant, received) serves the tenant's lookups: no index of its own.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, db_index=False, related_name="+")
    component = models.ForeignKey(
        Component, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    outcome = models.CharField(max_length=16, choices=UnifiedPushOutcome.choices)
    urgency = models.SmallIntegerField(choices=UnifiedPushUrgency.choices)
    received = models.DateTimeField()
    finished = models.DateTimeField(help_text="Delivered, or when it ended otherwise.")
    size = models.PositiveIntegerField(help_text="Body bytes.")
    ttl = models.PositiveIntegerField(help_text="Seconds granted.")
    attempts = models.PositiveSmallIntegerField(default=0)

    class Meta:
        db_table = "relay_unifiedpushdelivery"
        ordering = ["-received"]
        verbose_name = "UnifiedPush delivery"
        verbose_name_plural = "UnifiedPush deliveries"
        indexes = [
            models.Index(fields=["tenant", "received"], name="up_delivery_tenant"),
            models.Index(fields=["outcome", "received"], name="up_delivery_outcome"),
        ]

    def __str__(self) -> str:
        return f"UnifiedPush {self.outcome} {self.pk}"


class ReportUnifiedPush(TenantReportRow):
    """UnifiedPush messages (the Matrix gateway's notifications included) of one day, tenant
    and component: received, how each ended, and the body bytes handed to phones. Written by
    the Spark reports (analytics.writer), read-only in the admin."""

    component_id = models.BigIntegerField(null=True, blank=True)
    component_name = models.CharField(max_length=255, blank=True)
    received = models.BigIntegerField(default=0)
    delivered = models.BigIntegerField(default=0)
    expired = models.BigIntegerField(default=0)
    revoked = models.BigIntegerField(default=0)
    replaced = models.BigIntegerField(default=0)
    withdrawn = models.BigIntegerField(default=0)
    dropped = models.BigIntegerField(default=0)
    bytes_relayed = models.BigIntegerField(default=0)

    class Meta:
        db_table = "relay_reportunifiedpush"
        ordering = ["-day", "tenant_name", "component_name"]
        verbose_name = "UnifiedPush report"
        indexes = [
            models.Index(fields=["day"], name="relay_repor_day_2dc920_idx"),
            models.Index(fields=["tenant_id"], name="relay_repor_tenant__0570c9_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.tenant_name} {self.component_name}: {self.received}"
