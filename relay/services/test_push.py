"""A test push from the admin: the whole path (queue, worker, credentials, provider, device)
is exercised exactly as a publish would, and the outcome lands in the delivery log."""

from __future__ import annotations

import logging
import uuid

from django.utils import timezone

from relay.models import Registration
from relay.services.queue import SendJob, enqueue_send

log = logging.getLogger(__name__)


def send_test_push(*, registration: Registration, important: bool = True) -> SendJob:
    """Queue one content-free wake-up for a registration; raises QueueUnavailable.

    The publishing domain is the account's own domain, as if its server had published.
    """
    job = enqueue_send(
        SendJob(
            push_id=str(uuid.uuid4()),
            registration_id=registration.pk,
            publishing_domain=registration.account_domain,
            important=important,
            received=timezone.now().isoformat(),
            app=registration.app_id,
        )
    )
    log.info(
        "admin.test_push_queued",
        extra={"push_id": job.push_id, "registration_id": registration.pk},
    )
    return job
