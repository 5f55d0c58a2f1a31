"""The register iq (`<register xmlns='…unified-push' application instance/>`): checks, then an
endpoint; no database row is written (the token routes by itself)."""

from __future__ import annotations

import base64
import binascii
import enum
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from relay.models import Component
from relay.services.publishing import domain_allowed
from relay.unifiedpush import endpoint_urls
from relay.unifiedpush.models import settings_of
from relay.unifiedpush.services import tokens

log = logging.getLogger(__name__)

MAX_ENDPOINT_BYTES = 1000  # UnifiedPush server spec: an endpoint is at most 1000 bytes
PUSH_PATH = "/push/"


class Refusal(enum.Enum):
    """Why a registration is refused, with the XMPP error it is answered with."""

    NOT_SERVED = ("service-unavailable", "cancel")  # this component has no UnifiedPush
    BAD_REQUEST = ("bad-request", "modify")  # not base64 of 32 bytes, or not a full JID
    FORBIDDEN = ("forbidden", "auth")  # the account's domain is not allowed by the tenant
    TOO_LONG = ("not-acceptable", "modify")  # the endpoint would exceed 1000 bytes
    SUSPENDED = ("resource-constraint", "wait")  # the tenant is suspended for now

    @property
    def condition(self) -> str:
        return self.value[0]

    @property
    def error_type(self) -> str:
        return self.value[1]


class Refused(Exception):
    def __init__(self, refusal: Refusal, text: str = "") -> None:
        super().__init__(text or refusal.condition)
        self.refusal = refusal
        self.text = text


@dataclass(frozen=True, slots=True)
class Registered:
    endpoint: str
    expiration: str  # ISO 8601 UTC, as `up` writes it
    recipient_jid: str


def decode_id(value: str | None, name: str) -> bytes:
    """`application` and `instance` are base64 of exactly 32 bytes (salted SHA-256 hashes)."""
    if not value or len(value) > 64:
        raise Refused(Refusal.BAD_REQUEST, f"{name} must be base64 of 32 bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise Refused(Refusal.BAD_REQUEST, f"{name} must be base64 of 32 bytes")
    return raw


def iso_utc(timestamp: int) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def endpoint_url(base_url: str, token: str) -> str:
    """In ASCII, whatever an old row holds: application servers put it in request lines."""
    return endpoint_urls.ascii_form(base_url).rstrip("/") + PUSH_PATH + token


def register(
    *,
    component_id: int,
    jid: str,
    domain: str,
    has_resource: bool,
    application: str | None,
    instance: str | None,
    now: float,
) -> Registered:
    """An endpoint for (full JID, application, instance) on this component, or `Refused`.

    The component and its tenant are read fresh: a tenant's policy (suspension, allowed
    domains) applies from the next registration on.
    """
    component = (
        Component.objects.select_related("tenant", "unifiedpush_settings")
        .only(
            "id",
            "enabled",
            "unifiedpush_settings__endpoint_url",
            "unifiedpush_settings__token_lifetime_days",
            "tenant__suspended",
            "tenant__allowed_domains",
        )
        .filter(pk=component_id)
        .first()
    )
    settings = None if component is None else settings_of(component)
    if component is None or not component.enabled or settings is None:
        raise Refused(Refusal.NOT_SERVED, "this component does not serve UnifiedPush")
    application_raw = decode_id(application, "application")
    instance_raw = decode_id(instance, "instance")
    if not has_resource:
        raise Refused(Refusal.BAD_REQUEST, "register from the full JID that receives pushes")
    if component.tenant.suspended:
        raise Refused(Refusal.SUSPENDED)
    if not domain_allowed(allowed_domains=component.tenant.allowed_domains, domain=domain):
        raise Refused(Refusal.FORBIDDEN, "accounts of this domain may not register here")
    expires = int(now) + settings.token_lifetime_days * 86400
    token, _ = tokens.issue(
        jid=jid,
        application=application_raw,
        instance=instance_raw,
        component_id=component.pk,
        expires=expires,
    )
    url = endpoint_url(settings.endpoint_url, token)
    if len(url.encode()) > MAX_ENDPOINT_BYTES:
        raise Refused(Refusal.TOO_LONG, "the account's address is too long for an endpoint")
    log.info("unifiedpush.registered", extra={"component_id": component.pk})
    return Registered(endpoint=url, expiration=iso_utc(expires), recipient_jid=jid)
