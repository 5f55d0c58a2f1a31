"""Model signal receivers: each only hands the instance to the service that knows what to do.

Registrations can disappear by ways no service sees (the admin, deleting an app, component or
tenant, a queryset's delete()): the lifecycle log must hear of every one.
"""

from __future__ import annotations

from typing import Any

from django.db.models.signals import pre_delete
from django.dispatch import receiver

from relay.models import Registration
from relay.services import lifecycle


@receiver(pre_delete, sender=Registration, dispatch_uid="relay.registration_deleted")
def registration_deleted(sender: type[Registration], instance: Registration, **_: Any) -> None:
    lifecycle.deleting(instance)
