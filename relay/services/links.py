"""What the gateway reports about its component links, for the admin and health pages.

Which links a gateway holds is relay.services.link_leases' business."""

from __future__ import annotations

from django.utils import timezone

from relay import metrics
from relay.models import Component, ComponentLink, LinkState
from relay.services import link_leases


def record_link_state(
    *, component_id: int, state: LinkState, error: str = "", gateway: str = ""
) -> None:
    """`gateway`: the reporting gateway; a report from one that no longer holds the link's
    lease (it lost it, another took over) would overwrite the holder's, so it is dropped."""
    if gateway and not link_leases.holds(gateway=gateway, component_id=component_id):
        return
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
    return component.app.name if component.app is not None else ""


def note_link_state(*, component: Component, state: LinkState) -> None:
    """The link's state for /metrics (relay_gateway_link_up): up, or not (down, connecting)."""
    metrics.set_link(component.pk, _app_name(component), state == LinkState.UP)


def forget_link(*, component: Component) -> None:
    """A removed or disabled component's link leaves /metrics."""
    metrics.set_link(component.pk, _app_name(component), None)
