"""What the operators' security keeps: passkeys, tenants' second-factor policy, session
epochs and the audit trail. TOTP devices and recovery codes are django-otp's own models."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django_otp.models import Device, TimestampMixin


class WebAuthnKey(TimestampMixin, Device):
    """A security key or passkey of a staff member (WebAuthn), usable as their second step.

    A django-otp device, so `request.user.is_verified()` and the device lists treat it like
    a TOTP device; it is verified by an assertion (`services.passkeys`), never by a token."""

    credential_id = models.CharField(max_length=1400, unique=True, help_text="base64url")
    public_key = models.TextField(help_text="COSE public key, base64url.")
    sign_count = models.PositiveBigIntegerField(default=0)
    transports = models.JSONField(default=list, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "security key or passkey"

    def verify_token(self, token: object) -> bool:
        """Not a token device: only an assertion verifies it."""
        return False


class TenantSecurityPolicy(models.Model):
    """What a tenant's own staff must do to use the admin; set by operators.

    A tenant without a policy row gets the default: the second factor is required."""

    tenant = models.OneToOneField(
        "relay.Tenant", on_delete=models.CASCADE, related_name="security_policy"
    )
    second_factor_required = models.BooleanField(
        default=True,
        help_text="The tenant's staff pass a second step (TOTP, security key or passkey, or a "
        "recovery code) after their password.",
    )
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "tenant security policy"
        verbose_name_plural = "tenant security policies"

    def __str__(self) -> str:
        required = "required" if self.second_factor_required else "not required"
        return f"{self.tenant}: second factor {required}"


class SessionEpoch(models.Model):
    """Sessions of this user that began (or were last renewed) before `not_before` are over:
    "log out everywhere", a password or device change."""

    # No database constraint: deleting a user removes their devices first, which ends their
    # sessions (a row written while the user's own deletion is under way).
    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        db_constraint=False,
        related_name="session_epoch",
    )
    not_before = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.user_id}: sessions from {self.not_before.isoformat()}"


class AuditAction(models.TextChoices):
    CREATED = "created", "created"
    CHANGED = "changed", "changed"
    DELETED = "deleted", "deleted"
    LOGGED_IN = "logged_in", "logged in"
    LOGGED_OUT = "logged_out", "logged out"
    LOGIN_FAILED = "login_failed", "login failed"
    SECOND_STEP_PASSED = "second_step", "passed the second step"
    SECOND_STEP_FAILED = "second_step_failed", "failed the second step"
    SESSIONS_ENDED = "sessions_ended", "sessions ended"


class AuditEntry(models.Model):
    """One change or security event: who, when, what (field names, never values), from where.

    Written by `services.audit` only; kept for RELAY_RETENTION_DAYS like the other records."""

    at = models.DateTimeField(db_index=True)
    # No database constraint on these two: an entry outlives the user or tenant it names
    # (their deletion is itself recorded, in the same transaction).
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        null=True,
        blank=True,
        related_name="+",
        help_text="The staff member who acted, when one did.",
    )
    actor = models.CharField(
        max_length=300, help_text="The user's name, or the command and the host's user."
    )
    address = models.CharField(max_length=64, blank=True, help_text="The client's address.")
    action = models.CharField(max_length=24, choices=AuditAction.choices)
    object_type = models.CharField(max_length=100, blank=True)
    object_id = models.CharField(max_length=64, blank=True)
    object_repr = models.CharField(max_length=200, blank=True)
    fields = models.JSONField(
        default=list, blank=True, help_text="Names of the changed fields, never their values."
    )
    detail = models.CharField(max_length=300, blank=True)
    tenant = models.ForeignKey(
        "relay.Tenant",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        null=True,
        blank=True,
        related_name="+",
        help_text="The tenant the object belongs to: its staff see the entry.",
    )

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["tenant", "at"])]

    def __str__(self) -> str:
        return f"{self.at.isoformat()} {self.actor} {self.action} {self.object_type}"
