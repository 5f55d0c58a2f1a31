"""What the gateway reports about its component links, for the admin and health pages."""

from __future__ import annotations

from django.utils import timezone

from relay import metrics
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


def _app_name(component: Component) -> str:
    return component.app.name if component.app_id is not None else ""


def note_link_state(*, component: Component, state: LinkState) -> None:
    """The link's state for /metrics (relay_gateway_link_up): up, or not (down, connecting)."""
    metrics.set_link(component.pk, _app_name(component), state == LinkState.UP)


def forget_link(*, component: Component) -> None:
    """A removed or disabled component's link leaves /metrics."""
    metrics.set_link(component.pk, _app_name(component), None)
