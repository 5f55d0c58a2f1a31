"""What the gateway reports about its component links, for the admin and health pages."""

from __future__ import annotations

from django.utils import timezone

from relay.models import Component, ComponentLink, LinkState


def enabled_components() -> list[Component]:
    return list(Component.objects.filter(enabled=True).select_related("app"))


def record_link_state(*, component_id: int, state: LinkState, error: str = "") -> None:
    now = timezone.now()
    link, _ = ComponentLink.objects.get_or_create(component_id=component_id)
    if link.state != state:
        link.state = state
        link.since = now
    if error:
        link.last_error = error[:255]
        link.last_error_at = now
    link.save()
