"""Accepting an XEP-0357 publish from a user's server and queueing its send.

The answer decides whether users keep their push (protocols.md 1.3): ejabberd drops a
registration after ONE error that is not `wait`, so every passing trouble must map to a `wait`
verdict (UNAVAILABLE, RATE_LIMITED), and only a dead or unknown node, a wrong secret or a
domain the tenant does not allow to a hard one:

| situation                                         | verdict       | XMPP error         |
|---------------------------------------------------|---------------|--------------------|
| queued (now, or folded into a pending send)       | ACCEPTED      | none (`result`)    |
| unknown node, or the token is known dead          | UNKNOWN_NODE  | cancel item-not-found |
| wrong secret                                      | FORBIDDEN     | auth forbidden     |
| publishing domain not in the tenant's allowed list| FORBIDDEN     | auth forbidden     |
| tenant suspended; database or queue down          | UNAVAILABLE   | wait               |
| tenant over its rate limit                        | RATE_LIMITED  | wait resource-constraint |

A suspension is a passing state (billing, abuse review): registrations must survive it, so it
is `wait`. A domain the tenant removed from its allowed list is the tenant's lasting decision:
`forbidden` lets the user's server disable push for that account instead of publishing into the
void forever (Prosody never stops on `wait`), and the phone re-registers by itself once the
domain is allowed again.

The hot path is one database query, at most one round trip to the throttling store, and the
broker publish.
"""

from __future__ import annotations

import enum
import hmac
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import DatabaseError
from django.utils import timezone

from relay.models import Registration
from relay.services import queue, throttling

log = logging.getLogger(__name__)


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    UNKNOWN_NODE = "unknown-node"
    FORBIDDEN = "forbidden"
    UNAVAILABLE = "unavailable"
    RATE_LIMITED = "rate-limited"


@dataclass(frozen=True, slots=True)
class Publish:
    """A parsed publish; the body and sender are dropped before this is built."""

    component_id: int
    publishing_domain: str
    node: str
    secret: str
    important: bool
    message_count: int | None = None
    pending_subscription_count: int | None = None
    received: datetime | None = None


def domain_allowed(*, allowed_domains: str, domain: str) -> bool:
    """Whether a tenant's allowed list (one per line; `*.example.org` for subdomains; empty
    allows any) admits `domain`."""
    patterns = [line.strip().lower() for line in allowed_domains.splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    if not patterns:
        return True
    domain = domain.strip().lower().rstrip(".")
    for pattern in patterns:
        if pattern.startswith("*."):
            if domain.endswith(pattern[1:]):
                return True
        elif domain == pattern:
            return True
    return False


def _find_registration(publish: Publish) -> Registration | None:
    return (
        Registration.objects.filter(
            component_id=publish.component_id,
            node=publish.node,
            # "": a Windows account registered by account id, bound at its first publish.
            account_domain__in=(publish.publishing_domain, ""),
        )
        .select_related("app__tenant")
        .only(
            "id",
            "node",
            "secret",
            "account_domain",
            "dead_since",
            "service",
            "app_id",
            "app__tenant__id",
            "app__tenant__created",
            "app__tenant__suspended",
            "app__tenant__allowed_domains",
            "app__tenant__rate_limit_per_second",
            "app__tenant__rate_limit_burst",
        )
        .first()
    )


def accept_publish(publish: Publish) -> Verdict:
    """Check node, secret and tenant policy, then queue the send durably before answering."""
    received = publish.received or timezone.now()
    try:
        registration = _find_registration(publish)
    except DatabaseError:
        log.warning("publish.database_unavailable", extra={"component": publish.component_id})
        return Verdict.UNAVAILABLE
    if registration is None or registration.dead_since is not None:
        return Verdict.UNKNOWN_NODE
    if not hmac.compare_digest(registration.secret.encode(), publish.secret.encode()):
        log.info("publish.forbidden", extra={"component": publish.component_id})
        return Verdict.FORBIDDEN
    if not registration.account_domain:
        # The UWPX client names accounts by hash only (relay.services.uwpx): the first server
        # to publish with the right node and secret owns the registration from now on.
        try:
            Registration.objects.filter(pk=registration.pk, account_domain="").update(
                account_domain=publish.publishing_domain
            )
        except DatabaseError:
            return Verdict.UNAVAILABLE
    tenant = registration.app.tenant
    if tenant.suspended:
        log.info("publish.tenant_suspended", extra={"tenant": tenant.pk})
        return Verdict.UNAVAILABLE
    if not domain_allowed(allowed_domains=tenant.allowed_domains, domain=publish.publishing_domain):
        log.info("publish.domain_not_allowed", extra={"tenant": tenant.pk})
        return Verdict.FORBIDDEN

    push_id = str(uuid.uuid4())
    admission = throttling.admit(
        tenant=tenant,
        registration=registration,
        push_id=push_id,
        fold=throttling.Fold(
            important=publish.important,
            message_count=publish.message_count,
            pending_subscription_count=publish.pending_subscription_count,
        ),
    )
    if admission.decision is throttling.Decision.LIMITED:
        log.info(
            "publish.rate_limited",
            extra={"tenant": tenant.pk, "retry_in": round(admission.delay, 3)},
        )
        return Verdict.RATE_LIMITED
    if admission.decision is throttling.Decision.FOLDED:
        log.info("publish.coalesced", extra={"push_id": admission.push_id})
        return Verdict.ACCEPTED

    scheduled = admission.decision is throttling.Decision.SCHEDULE
    job = queue.SendJob(
        push_id=push_id,
        registration_id=registration.pk,
        publishing_domain=publish.publishing_domain,
        important=publish.important,
        message_count=publish.message_count,
        pending_subscription_count=publish.pending_subscription_count,
        received=received.isoformat(),
        coalesced=scheduled,
    )
    try:
        queue.enqueue_send(job, countdown=admission.delay if scheduled else None)
    except queue.QueueUnavailable:
        log.warning("publish.queue_unavailable", extra={"component": publish.component_id})
        if scheduled:
            throttling.abandon(registration=registration, push_id=push_id)
        return Verdict.UNAVAILABLE
    return Verdict.ACCEPTED
