"""The relay's data: who the tenants are, their apps and component links, and registrations.

Privacy rule: no account JID, message body or sender is ever stored. A registration keeps the
account's domain and a salted hash, the provider token (the device's address) and the node and
secret that the user's server must present.
"""

from __future__ import annotations

import secrets
import uuid

from django.db import models
from django.db.models import Q

from relay.crypto import EncryptedTextField
from relay.providers.base import Outcome
from relay.providers.registry import PROVIDERS


def new_public_key() -> str:
    """URL-safe, and never starting with "-", which command lines would take for an option."""
    while True:
        key = secrets.token_urlsafe(16)
        if not key.startswith("-"):
            return key


# The push providers a registration can be sent through: relay.providers.registry's table.
Service = models.TextChoices(  # type: ignore[call-overload]
    "Service", [(spec.service.upper(), (spec.service, spec.label)) for spec in PROVIDERS]
)


class Tenant(models.Model):
    """A hosting provider's customer: owns apps and component links."""

    name = models.SlugField(max_length=100, unique=True)
    display_name = models.CharField(max_length=200, blank=True)
    suspended = models.BooleanField(
        default=False, help_text="Publishes are answered with a `wait` error; nothing is sent."
    )
    allowed_domains = models.TextField(
        blank=True,
        help_text="XMPP domains whose servers may publish, one per line; empty allows any.",
    )
    rate_limit_per_second = models.FloatField(
        null=True, blank=True, help_text="Sustained publishes per second; empty uses the default."
    )
    rate_limit_burst = models.PositiveIntegerField(
        null=True, blank=True, help_text="Publishes allowed in a burst; empty uses the default."
    )
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        # Operator status is explicit (relay.services.tenancy): a staff user in no tenant's
        # staff group sees nothing unless a superuser or holding this permission.
        permissions = [("operate_all_tenants", "Can see and change every tenant (operator)")]

    def __str__(self) -> str:
        return self.display_name or self.name


class App(models.Model):
    """A push app of a tenant (e.g. a Conversations build): its provider credentials are its
    ProviderCredentials, one record per provider."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="apps")
    name = models.SlugField(max_length=100)
    public_key = models.CharField(
        max_length=32,
        unique=True,
        default=new_public_key,
        help_text="Identifies the app in HTTP API URLs; not a secret.",
    )
    # Payload shape per provider; empty means docs/protocols.md 1.4.
    payload_options = models.JSONField(default=dict, blank=True)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["tenant__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="app_unique_name_per_tenant")
        ]

    def __str__(self) -> str:
        return f"{self.tenant.name}/{self.name}"


class ProviderCredentials(models.Model):
    """One app's credentials and settings for one provider, encrypted as one JSON object.

    Which fields there are is the provider's business (its spec, relay/providers/<name>/);
    relay.services.credentials reads, validates and writes them. A change replaces the record
    (a new id), which is how a cached copy of the app learns it is stale.
    """

    app = models.ForeignKey(App, on_delete=models.CASCADE, related_name="credentials")
    service = models.CharField(max_length=8, choices=Service.choices)
    values = EncryptedTextField(help_text="The provider's fields as a JSON object.")
    not_after = models.DateTimeField(
        null=True, blank=True, help_text="When a credential in it expires (a certificate)."
    )
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "provider credentials"
        constraints = [
            models.UniqueConstraint(
                fields=["app", "service"], name="providercredentials_unique_service_per_app"
            )
        ]
        indexes = [models.Index(fields=["not_after"])]

    def __str__(self) -> str:
        return f"{self.service} credentials of app {self.app_id}"


class Component(models.Model):
    """An XEP-0114 link to one XMPP server: users of that server register and publish here."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="components")
    app = models.ForeignKey(
        App,
        on_delete=models.PROTECT,
        related_name="components",
        null=True,
        blank=True,
        help_text="The app whose devices register here with the p2 commands (FCM, APNs, WNS); "
        "empty for a component that serves only what a feature adds (see below).",
    )
    jid = models.CharField(max_length=255, unique=True, help_text="The component's JID.")
    secret = models.CharField(max_length=255, help_text="The XEP-0114 shared secret.")
    host = models.CharField(max_length=255, default="127.0.0.1")
    port = models.PositiveIntegerField(default=5347)
    enabled = models.BooleanField(default=True)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["jid"]

    def __str__(self) -> str:
        return self.jid

    @property
    def serves_p2(self) -> bool:
        """The p2 commands and XEP-0357 publishes need an app to send through."""
        return self.app_id is not None


class LinkState(models.TextChoices):
    CONNECTING = "connecting", "connecting"
    UP = "up", "up"
    DOWN = "down", "down"


class ComponentLink(models.Model):
    """What the gateway last saw of a component's link; written by the gateway only."""

    component = models.OneToOneField(Component, on_delete=models.CASCADE, related_name="link")
    state = models.CharField(max_length=16, choices=LinkState.choices, default=LinkState.DOWN)
    since = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=255, blank=True)
    last_error_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.component.jid}: {self.state}"


class GatewayInstance(models.Model):
    """A running gateway process (`manage.py run_gateway`), live while `expires` is ahead.

    Its heartbeat, renewed with its leases, tells the others how many share the links."""

    name = models.CharField(max_length=100, primary_key=True)
    started = models.DateTimeField()
    expires = models.DateTimeField()
    channel = models.CharField(
        max_length=300,
        blank=True,
        default="",
        help_text="host:port where its web processes hand it UnifiedPush messages, if any.",
    )

    def __str__(self) -> str:
        return self.name


class LinkLease(models.Model):
    """Which gateway may hold a component's link, until `expires` (database clock).

    Written by relay.services.link_leases only; `holder` is empty when released."""

    component = models.OneToOneField(
        Component, on_delete=models.CASCADE, primary_key=True, related_name="lease"
    )
    holder = models.CharField(max_length=100, blank=True, default="")
    expires = models.DateTimeField()
    acquired = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.component_id}: {self.holder or '-'}"


class Registration(models.Model):
    """One device (and optionally one room) of one account, reachable through one provider."""

    app = models.ForeignKey(App, on_delete=models.CASCADE, related_name="registrations")
    component = models.ForeignKey(Component, on_delete=models.CASCADE, related_name="registrations")
    service = models.CharField(max_length=8, choices=Service.choices)
    device_hash = models.CharField(
        max_length=64,
        help_text="sha1(bare JID + NUL + device id); sha256(device id + bare JID) for UWPX",
    )
    room_hash = models.CharField(
        max_length=64, blank=True, default="", help_text="sha1(room JID + NUL + device id)"
    )
    account_domain = models.CharField(max_length=255)
    token = models.TextField(help_text="The provider's address of the device.")
    node = models.CharField(max_length=64)
    secret = models.CharField(max_length=64)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)
    last_push = models.DateTimeField(null=True, blank=True)
    dead_since = models.DateTimeField(
        null=True, blank=True, help_text="Set when the provider said the token is gone."
    )

    class Meta:
        ordering = ["-updated"]
        constraints = [
            models.UniqueConstraint(
                fields=["component", "node"], name="registration_unique_node_per_component"
            ),
            models.UniqueConstraint(
                fields=["app", "service", "device_hash", "room_hash"],
                name="registration_unique_device_room_per_app_service",
            ),
            models.CheckConstraint(
                condition=Q(service__in=[s.value for s in Service]),
                name="registration_known_service",
            ),
        ]
        indexes = [models.Index(fields=["account_domain"])]

    def __str__(self) -> str:
        return f"{self.service}:{self.node}@{self.component_id}"


class Priority(models.TextChoices):
    HIGH = "high", "important"
    NORMAL = "normal", "silent"


class Delivery(models.Model):
    """One push as it went through us: the record reports are made from.

    It holds no JID, token or body on purpose; `push_id` tells duplicates apart.
    """

    push_id = models.UUIDField(default=uuid.uuid4, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="deliveries")
    app = models.ForeignKey(App, on_delete=models.CASCADE, related_name="deliveries")
    registration = models.ForeignKey(
        Registration, on_delete=models.SET_NULL, null=True, blank=True, related_name="deliveries"
    )
    provider = models.CharField(max_length=8, choices=Service.choices)
    publishing_domain = models.CharField(max_length=255)
    priority = models.CharField(max_length=8, choices=Priority.choices)
    received = models.DateTimeField()
    queued = models.DateTimeField()
    sent = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveSmallIntegerField(default=1)
    outcome = models.CharField(
        max_length=16, choices=[(outcome.value, outcome.label) for outcome in Outcome]
    )
    error_code = models.CharField(max_length=64, blank=True)
    coalesced = models.PositiveIntegerField(
        default=0, help_text="Later publishes folded into this send by burst coalescing."
    )

    class Meta:
        ordering = ["-received"]
        verbose_name_plural = "deliveries"
        indexes = [
            models.Index(fields=["tenant", "received"]),
            models.Index(fields=["app", "received"]),
            models.Index(fields=["outcome", "received"]),
        ]

    def __str__(self) -> str:
        return f"{self.provider} {self.outcome} {self.push_id}"


class DeadLetter(models.Model):
    """A push that ran out of retries (or could not be re-queued), kept for replay."""

    push_id = models.UUIDField(unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="dead_letters")
    app = models.ForeignKey(App, on_delete=models.CASCADE, related_name="dead_letters")
    registration = models.ForeignKey(
        Registration,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="dead_letters",
    )
    provider = models.CharField(max_length=8, choices=Service.choices)
    reason = models.CharField(max_length=64)
    attempts = models.PositiveSmallIntegerField()
    job = models.JSONField(help_text="The send job as queued: no token, JID or body.")
    created = models.DateTimeField(auto_now_add=True)
    replayed = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]
        indexes = [models.Index(fields=["tenant", "created"])]

    def __str__(self) -> str:
        return f"{self.provider} {self.reason} {self.push_id}"


class DeferredSend(models.Model):
    """A send put off until `due` (a provider's outage or rate limit, a backoff, a coalescing
    window): kept here, not as a broker countdown, and published by the sweep once due
    (relay/services/deferred.py)."""

    push_id = models.UUIDField(unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="deferred_sends")
    app = models.ForeignKey(App, on_delete=models.CASCADE, related_name="deferred_sends")
    due = models.DateTimeField()
    job = models.JSONField(help_text="The send job as it will be queued: no token, JID or body.")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["due"]
        indexes = [models.Index(fields=["due"]), models.Index(fields=["tenant", "due"])]

    def __str__(self) -> str:
        return f"{self.push_id} due {self.due.isoformat()}"


class TenantStaffGroup(models.Model):
    """Binds an auth group to a tenant: the group's members are that tenant's own staff.

    In the admin they see and change only their tenant's objects; the operator's staff are
    superusers or hold `relay.operate_all_tenants`; any other staff user sees nothing.
    """

    group = models.OneToOneField(
        "auth.Group", on_delete=models.CASCADE, related_name="tenant_binding"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="staff_groups")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "tenant staff group"

    def __str__(self) -> str:
        return f"{self.group.name} → {self.tenant}"


# The reports' records and daily aggregates live in their own module (registered here).
import relay.report_models  # noqa: E402, F401
