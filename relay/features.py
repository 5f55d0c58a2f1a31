"""What the feature apps add to the core and the admin, found through
their AppConfigs: the core loops over what is installed and never imports a feature.

A feature app (relay.unifiedpush, relay.windows) names its parts as attributes of its
AppConfig, dotted paths imported when first asked for (after the apps are loaded):

- `component_part`: its settings of a component (`ComponentPart`): a row per component that
  serves it, loaded with the component by the gateway, its section of a component in
  `load_tenants`, and its snippet on the component's admin page;
- `component_inlines`: admin inlines shown on the component's page;
- `gateway_feature`: its part of the gateway (xmppgateway/features.py).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

from django.apps import apps
from django.db import models
from django.utils.module_loading import import_string

from relay.models import Component


class ComponentPart(Protocol):
    """A feature's settings of one component: a row (a one-to-one `component` field) for a
    component that serves the feature, none for one that does not."""

    # Its section in a component's document (load_tenants), and its snippet's id.
    key: str
    # The row's model, and the component's accessor for it (the one-to-one's related name).
    model: type[models.Model]
    related_name: str
    # The heading of its snippet on the component's page.
    title: str

    def provisioned(self, section: Any, where: str) -> dict[str, Any]:
        """The row's values from its section of a component's document; ValueError with
        the place (`where`) and the reason when the section is wrong."""
        ...

    def serves(self, component: Component) -> bool: ...

    def snippet(self, component: Component) -> str:
        """What the operator and the users need to use it on this component ("" if none)."""
        ...


def _named(attribute: str) -> list[str]:
    """The dotted paths the installed apps give for `attribute`, in INSTALLED_APPS order."""
    found: list[str] = []
    for config in apps.get_app_configs():
        value = getattr(config, attribute, None)
        if isinstance(value, str):
            found += [value] if value else []
        elif value:
            found += list(value)
    return found


@functools.cache
def component_parts() -> tuple[ComponentPart, ...]:
    return tuple(import_string(path) for path in _named("component_part"))


def component_related_names() -> tuple[str, ...]:
    """What to load with a component (select_related) so that no part needs a query."""
    return tuple(part.related_name for part in component_parts())


def component_inlines() -> list[type[Any]]:
    return [import_string(path) for path in _named("component_inlines")]
