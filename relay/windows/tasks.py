"""The Windows API's beat task (found by Celery's autodiscovery of installed apps), and its
entry in beat's schedule (relay.features: `beat_schedule`)."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from relay import conf
from relay.windows import services


# The name stays the one beat schedules already carry.
@shared_task(name="relay.remove_stale_uwpx_devices", ignore_result=True)
def remove_stale_uwpx_devices() -> int:
    """Beat task: Windows devices whose client went silent."""
    return services.remove_stale_devices()


def beat_schedule() -> dict[str, dict[str, Any]]:
    return {
        "remove-stale-uwpx-devices": {
            "task": "relay.remove_stale_uwpx_devices",
            "schedule": conf.current().uwpx_stale_check_seconds,
        }
    }
