"""What the feature apps add to the core, the admin, the web server and beat, found through
their AppConfigs: the core loops over what is installed and never imports a feature.

A feature app (relay.unifiedpush, relay.windows) names its parts as attributes of its
AppConfig, dotted paths imported when first asked for (after the apps are loaded):

- `component_part`: its settings of a component (`ComponentPart`): a row per component that
  serves it, loaded with the component by the gateway, its section of a component in
  `load_tenants`, and its snippet on the component's admin page;
- `component_inlines`: admin inlines shown on the component's page;
- `urlpatterns`: its Django URL patterns (a list, by dotted path), included by the site;
- `web_resources`: routes the web process serves on its event loop (`WebResource`);
- `beat_schedule`: a function returning its periodic tasks (Celery beat entries by name);
- `state_metrics`: its gauges of /metrics read from the database at a scrape (`StateMetrics`);
- `kept_registrations`: a filter (Q) of the registrations it removes by its own rule, which the
  core's clean-up of unused registrations leaves alone;
- `report_charts`: charts of its own on the admin's reports page (`ReportChart`);
- `gateway_feature`: its part of the gateway (xmppgateway/features.py).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Protocol

from django.apps import apps
from django.db import models
from django.utils.module_loading import import_string

from relay.models import Component

Answer = tuple[int, list[tuple[str, str]], bytes]
Header = Callable[[str], str | None]
InThread = Callable[[Callable[[], Any]], Awaitable[Any]]


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


class WebResource(Protocol):
    """A route the web process serves on its event loop (pushsite/server.py), for the paths
    `paths` matches whole."""

    paths: re.Pattern[str]
    max_body_bytes: int

    def refusal(self, method: str, path: str, header: Header) -> Answer | None: ...

    async def answer(
        self, method: str, path: str, header: Header, body: bytes, in_thread: InThread
    ) -> Answer: ...


class StateMetrics(Protocol):
    """Gauges of a feature's stored state, read when the web process's /metrics is scraped
    (relay/services/observability.py): in its database part, so an outage leaves them out."""

    names: tuple[str, ...]

    def read(self) -> list[Any]:
        """prometheus_client metric families."""
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


def component_parts() -> tuple[ComponentPart, ...]:
    return tuple(import_string(path) for path in _named("component_part"))


def component_related_names() -> tuple[str, ...]:
    """What to load with a component (select_related) so that no part needs a query."""
    return tuple(part.related_name for part in component_parts())


def component_inlines() -> list[type[Any]]:
    return [import_string(path) for path in _named("component_inlines")]


def urlpatterns() -> list[Any]:
    """The feature apps' Django URL patterns, which the site's URLconf includes."""
    return [pattern for path in _named("urlpatterns") for pattern in import_string(path)]


def web_resources() -> list[WebResource]:
    """One instance of each feature's web resource (a web worker makes its own)."""
    return [import_string(path)() for path in _named("web_resources")]


def beat_schedule() -> dict[str, dict[str, Any]]:
    """Every feature's beat entries by name (a name the core's schedule has stays the
    core's: pushsite/celery.py)."""
    schedule: dict[str, dict[str, Any]] = {}
    for path in _named("beat_schedule"):
        entries: Mapping[str, dict[str, Any]] = import_string(path)()
        schedule.update(entries)
    return schedule


def state_metrics() -> list[StateMetrics]:
    return [import_string(path) for path in _named("state_metrics")]


def state_gauge_names() -> set[str]:
    """The names of the features' gauges (the core's: relay.metrics.STATE_GAUGES)."""
    return {name for part in state_metrics() for name in part.names}


class ReportChart(Protocol):
    """A feature's chart on the admin's reports page, scoped like the page (`tenant_ids`:
    the tenants the viewer may see, None for all)."""

    # Its heading, and the id of the element that holds it.
    title: str
    element_id: str

    def render(self, tenant_ids: Collection[int] | None) -> str:
        """The chart, as safe HTML (the admin's inline SVG)."""
        ...


def report_charts() -> list[ReportChart]:
    return [import_string(path) for path in _named("report_charts")]


def kept_registrations() -> list[models.Q]:
    """Filters of the registrations the feature apps remove by their own rules."""
    return [import_string(path) for path in _named("kept_registrations")]
