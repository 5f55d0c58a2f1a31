"""Removing the devices that stopped announcing themselves (beat's periodic task)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from relay import conf
from relay.models import Registration
from relay.services import lifecycle
from relay.windows.models import WnsDevice

log = logging.getLogger("relay.windows.services")

# The devices' accounts go with their device (below), never by the core's rule for unused
# registrations (relay.features: `kept_registrations`).
KEPT_REGISTRATIONS = Q(wns_account__isnull=False)


def remove_stale_devices(
    *, older_than_days: float | None = None, now: datetime | None = None
) -> int:
    """Delete devices (and their accounts) the client has not updated for that many days.

    WNS channels expire after 30 days and the client sends a new one when it starts, so a
    device silent for longer has a dead channel anyway. 0 or less disables the removal.
    """
    days = conf.current().uwpx_stale_days if older_than_days is None else older_than_days
    if days <= 0:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    removed = 0
    while True:
        batch = list(
            WnsDevice.objects.filter(updated__lt=cutoff).values_list("id", flat=True)[:1000]
        )
        if not batch:
            break
        lifecycle.delete_logged(Registration.objects.filter(wns_account__device_id__in=batch))
        WnsDevice.objects.filter(id__in=batch).delete()
        removed += len(batch)
    log.info("uwpx.stale_devices_removed", extra={"devices": removed, "days": days})
    return removed
