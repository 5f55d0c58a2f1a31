"""What the reports are made of, beside the Delivery records, and what they produce.

Recorded by the relay (no JID, token, secret or body in any of them):

- `RegistrationEvent`: a registration's lifecycle (created, token renewed, died, removed),
  with the change it made to the number of live registrations;
- `PublishTally`: publishes per minute by verdict, including those that never become a
  Delivery (rate-limited, refused, coalesced);
- `RetentionCut`: how far the retention has pruned each of those records (and the
  deliveries), so the reports never remake a day from what the pruning left of it.

Written back by the Spark reports (`analytics/`, through `analytics.writer`), one row per day
and key, read-only in the admin. Tenants and apps are copied by id and name, not linked: a
billing figure outlives a deleted tenant. A feature app keeps its own aggregates (on
`TenantReportRow`) with its models.
"""

from __future__ import annotations

from django.db import models

from relay.models import App, Service, Tenant


class RegistrationEventKind(models.TextChoices):
    CREATED = "created", "created"
    RENEWED = "renewed", "token renewed"
    DIED = "died", "died (provider said the token is gone)"
    REMOVED = "removed", "removed"


class RegistrationEvent(models.Model):
    """One step in a registration's life; `live_change` keeps the live count reconstructible.

    `live_change` is +1 when a live registration appeared (created, or a dead one renewed),
    -1 when one stopped being live (died, or removed while alive), 0 otherwise. The number of
    live registrations at the end of a past day is today's live count minus the changes
    logged since, so the log only needs to reach back as far as the reports do.
    """

    at = models.DateTimeField(db_index=True)
    # The log outlives the registration, its app and its tenant (deleting them logs the
    # removals): the ids stay, with no constraint and no cascade.
    tenant = models.ForeignKey(
        Tenant, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    app = models.ForeignKey(App, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+")
    provider = models.CharField(max_length=8, choices=Service.choices)
    registration_id = models.BigIntegerField()
    kind = models.CharField(max_length=16, choices=RegistrationEventKind.choices)
    live_change = models.SmallIntegerField()

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.kind} {self.provider} registration {self.registration_id}"


class PublishVerdict(models.TextChoices):
    """How the gateway answered a publish; `coalesced` is an accepted publish folded into a
    pending send (it never gets a Delivery of its own)."""

    ACCEPTED = "accepted", "accepted"
    COALESCED = "coalesced", "coalesced"
    RATE_LIMITED = "rate-limited", "rate-limited"
    UNKNOWN_NODE = "unknown-node", "refused: unknown node"
    FORBIDDEN = "forbidden", "refused: forbidden"
    UNAVAILABLE = "unavailable", "unavailable (wait)"


class PublishTally(models.Model):
    """Publishes per minute, tenant, app, provider, publishing domain and verdict.

    Upserted once per gateway batch (`relay.services.tallies`). `provider` is empty when the
    node was unknown (no registration, so no provider).
    """

    minute = models.DateTimeField()
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    app = models.ForeignKey(App, on_delete=models.CASCADE, related_name="+")
    provider = models.CharField(max_length=8, blank=True)
    publishing_domain = models.CharField(max_length=255)
    verdict = models.CharField(max_length=16, choices=PublishVerdict.choices)
    count = models.PositiveIntegerField()

    class Meta:
        ordering = ["-minute"]
        verbose_name_plural = "publish tallies"
        constraints = [
            models.UniqueConstraint(
                fields=["minute", "tenant", "app", "provider", "publishing_domain", "verdict"],
                name="publishtally_unique_key",
            )
        ]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.verdict} {self.count}"


class RetentionCut(models.Model):
    """How far the retention pruned a table of records: rows older than `pruned_before` may
    be gone. Written (only ever moved later) before the first of those rows is deleted, so a
    report run that sees a row missing also sees the cut, on the replica too (it replays the
    primary's commits in order). The reports never recompute a day that starts before the
    cut: its report was made from records that no longer all exist."""

    table_name = models.CharField(max_length=63, unique=True)
    pruned_before = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.table_name} pruned before {self.pruned_before:%Y-%m-%d %H:%M}"


# --- daily aggregates written by the reports ----------------------------------------------------


class ReportLevel(models.TextChoices):
    PROVIDER = "provider", "tenant, app and provider"
    APP = "app", "tenant and app"
    TENANT = "tenant", "tenant"
    ALL = "all", "all tenants"


class TenantReportRow(models.Model):
    """A daily aggregate's day and tenant, the tenant copied by id and name (not linked); a
    feature app's aggregates derive from it too."""

    day = models.DateField()
    tenant_id = models.BigIntegerField(null=True, blank=True)
    tenant_name = models.CharField(max_length=100, blank=True)

    class Meta:
        abstract = True


class ReportUsage(TenantReportRow):
    """Usage of one day at one level (`level`: which of tenant, app, provider are set)."""

    level = models.CharField(max_length=8, choices=ReportLevel.choices)
    app_id = models.BigIntegerField(null=True, blank=True)
    app_name = models.CharField(max_length=100, blank=True)
    provider = models.CharField(max_length=8, blank=True)
    publishes_received = models.BigIntegerField(default=0)
    pushes_sent = models.BigIntegerField(default=0)
    delivered = models.BigIntegerField(default=0)
    dead_tokens = models.BigIntegerField(default=0)
    retried = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    coalesced = models.BigIntegerField(default=0)
    rate_limited = models.BigIntegerField(default=0)
    refused = models.BigIntegerField(default=0)
    unavailable = models.BigIntegerField(default=0)
    bytes_relayed = models.BigIntegerField(
        default=0, help_text="Body bytes of the UnifiedPush messages delivered to phones."
    )
    success_rate = models.FloatField(null=True, blank=True)
    latency_p50_ms = models.FloatField(null=True, blank=True)
    latency_p95_ms = models.FloatField(null=True, blank=True)
    latency_p99_ms = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-day", "tenant_name", "app_name", "provider"]
        verbose_name = "usage report"
        indexes = [models.Index(fields=["day", "level"]), models.Index(fields=["tenant_id"])]

    def __str__(self) -> str:
        return f"{self.day} {self.tenant_name or 'all'} {self.app_name} {self.provider}"


class ReportRegistrations(TenantReportRow):
    app_id = models.BigIntegerField()
    app_name = models.CharField(max_length=100, blank=True)
    provider = models.CharField(max_length=8)
    active = models.BigIntegerField(default=0)
    new = models.BigIntegerField(default=0)
    renewed = models.BigIntegerField(default=0)
    died = models.BigIntegerField(default=0)
    removed = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-day", "tenant_name", "app_name", "provider"]
        verbose_name = "registrations report"
        verbose_name_plural = "registrations reports"
        indexes = [models.Index(fields=["day"]), models.Index(fields=["tenant_id"])]

    def __str__(self) -> str:
        return f"{self.day} {self.tenant_name} {self.app_name} {self.provider}"


class ReportDomain(TenantReportRow):
    """A publishing domain among a tenant's top ones of the day, by volume or failure rate."""

    publishing_domain = models.CharField(max_length=255)
    publishes_received = models.BigIntegerField(default=0)
    pushes_sent = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    failure_rate = models.FloatField(null=True, blank=True)
    rank_by_volume = models.IntegerField(null=True, blank=True)
    rank_by_failure_rate = models.IntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-day", "tenant_name", "rank_by_volume"]
        verbose_name = "publishing domain report"
        indexes = [models.Index(fields=["day"]), models.Index(fields=["tenant_id"])]

    def __str__(self) -> str:
        return f"{self.day} {self.tenant_name} {self.publishing_domain}"


class ReportErrorCode(TenantReportRow):
    app_id = models.BigIntegerField(null=True, blank=True)  # none for UnifiedPush
    app_name = models.CharField(max_length=100, blank=True)
    provider = models.CharField(max_length=8)
    outcome = models.CharField(max_length=16)
    error_code = models.CharField(max_length=64)
    count = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-day", "-count"]
        verbose_name = "provider error code report"
        indexes = [models.Index(fields=["day"]), models.Index(fields=["tenant_id"])]

    def __str__(self) -> str:
        return f"{self.day} {self.provider} {self.error_code}: {self.count}"


class ReportAnomaly(TenantReportRow):
    """A tenant, app or publishing domain whose volume or failure rate moved beyond a
    threshold against its own previous seven days."""

    scope = models.CharField(max_length=8)  # tenant, app, domain
    app_id = models.BigIntegerField(null=True, blank=True)
    app_name = models.CharField(max_length=100, blank=True)
    publishing_domain = models.CharField(max_length=255, blank=True)
    metric = models.CharField(max_length=16)  # volume, failure_rate
    value = models.FloatField()
    baseline = models.FloatField()
    threshold = models.FloatField()
    pushes_sent = models.BigIntegerField(default=0)
    detail = models.CharField(max_length=255)

    class Meta:
        ordering = ["-day", "tenant_name", "scope"]
        verbose_name = "anomaly"
        verbose_name_plural = "anomalies"
        indexes = [models.Index(fields=["day"]), models.Index(fields=["tenant_id"])]

    def __str__(self) -> str:
        return f"{self.day} {self.detail}"
