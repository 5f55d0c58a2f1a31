"""The Windows API's beat task (found by Celery's autodiscovery of installed apps)."""

from __future__ import annotations

from celery import shared_task

from relay.windows import services


# The name stays the one beat schedules already carry (CELERY_BEAT_SCHEDULE).
@shared_task(name="relay.remove_stale_uwpx_devices", ignore_result=True)
def remove_stale_uwpx_devices() -> int:
    """Beat task: Windows devices whose client went silent."""
    return services.remove_stale_devices()
