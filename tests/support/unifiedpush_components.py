"""Components that serve UnifiedPush (their settings row, relay.unifiedpush.models)."""

from __future__ import annotations

from typing import Any

from relay.models import Component
from relay.unifiedpush.models import ComponentSettings


def serving_unifiedpush(
    *, endpoint_url: str, token_lifetime_days: int = 7, **fields: Any
) -> Component:
    """A new component serving UnifiedPush at `endpoint_url` (stored as given, unchecked)."""
    component = Component.objects.create(**fields)
    ComponentSettings.objects.create(
        component=component, endpoint_url=endpoint_url, token_lifetime_days=token_lifetime_days
    )
    return component


def set_endpoint_url(component: Component, url: str) -> None:
    """Its endpoint URL changed in the database (as a row saved before a rule was)."""
    ComponentSettings.objects.filter(component=component).update(endpoint_url=url)
