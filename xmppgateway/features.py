"""What a feature app plugs into the gateway, and how the gateway finds the features.

The gateway holds the links and speaks the core's own protocol (p2: commands and publishes,
`xmppgateway.handlers`). A feature app (UnifiedPush, for one) names a class in its AppConfig
(`gateway_feature`, a dotted path); the gateway makes one of each per process and hands it
the events of every link. The gateway never imports a feature: the installed apps say which
there are.
"""

from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Protocol

from django.apps import apps
from django.utils.module_loading import import_string

from relay.models import Component
from xmppgateway.handlers import IqHandler, RunBlocking


class Sender(Protocol):
    """A link, as a feature writes to it."""

    def send_raw(self, data: str | bytes) -> None: ...


class GatewayFeature(Protocol):
    def iq_set_handlers(self) -> Mapping[str, IqHandler]:
        """The iq-set payloads it serves, by qualified tag."""
        ...

    def disco_features(self, component: Component) -> list[str]:
        """What disco#info announces for it on this component."""
        ...

    def link_up(self, component_id: int, component_jid: str, sender: Sender) -> None: ...

    def link_down(self, component_id: int) -> None: ...

    def on_iq_answer(self, component_id: int, iq: ET.Element) -> bool:
        """A result or error iq: True when it answered one of the feature's own iqs."""
        ...

    def on_presence(self, component_id: int, presence: ET.Element) -> bool: ...

    async def start(self) -> str:
        """Start its listeners; the address announced with the gateway's leases, or ""."""
        ...

    async def run(self, stopped: asyncio.Event) -> None:
        """Its background work, until `stopped` is set; then it finishes what it holds."""
        ...

    async def stop(self) -> None:
        """Close its listeners (after `run` ended)."""
        ...


def load(run_blocking: RunBlocking) -> list[GatewayFeature]:
    """One instance of every installed app's gateway feature, in INSTALLED_APPS order."""
    features: list[GatewayFeature] = []
    for config in apps.get_app_configs():
        path = getattr(config, "gateway_feature", "")
        if path:
            features.append(import_string(path)(run_blocking))
    return features
