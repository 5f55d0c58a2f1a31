"""Accepting an XEP-0357 publish from a user's server and queueing its send.

The answer decides whether users keep their push (protocols.md 1.3): ejabberd drops a
registration after ONE error that is not `wait`, so every passing trouble must map to
`Verdict.UNAVAILABLE`, and only a known-dead or unknown node to `Verdict.UNKNOWN_NODE`.
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
from relay.services import queue

log = logging.getLogger(__name__)


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    UNKNOWN_NODE = "unknown-node"
    FORBIDDEN = "forbidden"
    UNAVAILABLE = "unavailable"


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


def _find_registration(publish: Publish) -> Registration | None:
    return (
        Registration.objects.filter(
            component_id=publish.component_id,
            node=publish.node,
            account_domain=publish.publishing_domain,
        )
        .only("id", "secret", "dead_since", "service", "app_id")
        .first()
    )


def accept_publish(publish: Publish) -> Verdict:
    """Check node and secret, then queue the send durably before answering."""
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
    job = queue.SendJob(
        push_id=str(uuid.uuid4()),
        registration_id=registration.pk,
        publishing_domain=publish.publishing_domain,
        important=publish.important,
        message_count=publish.message_count,
        pending_subscription_count=publish.pending_subscription_count,
        received=received.isoformat(),
    )
    try:
        queue.enqueue_send(job)
    except queue.QueueUnavailable:
        log.warning("publish.queue_unavailable", extra={"component": publish.component_id})
        return Verdict.UNAVAILABLE
    return Verdict.ACCEPTED
