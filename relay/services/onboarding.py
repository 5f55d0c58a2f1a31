"""What an operator needs to connect a tenant's XMPP server: a strong secret and its config.

The snippets are what the server's admin pastes into Prosody or ejabberd; the relay's gateway
then connects to `host:port` as the component and picks up the change within seconds.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from relay import features
from relay.models import Component

# Characters that need no quoting in Lua or YAML strings and survive copy and paste.
SECRET_PATTERN = re.compile(r"^[A-Za-z0-9._~+/=-]{16,255}$")
SECRET_HELP = "16 to 255 characters: letters, digits and . _ ~ + / = -"
HIDDEN_SECRET = "<the component secret>"


def new_component_secret() -> str:
    """43 characters from 32 random bytes: strong, and safe inside Lua and YAML strings."""
    return secrets.token_urlsafe(32)


def valid_secret(secret: str) -> bool:
    """The one rule for a component secret, for the admin's form and `load_tenants` alike."""
    return bool(SECRET_PATTERN.fullmatch(secret))


@dataclass(frozen=True, slots=True)
class FeatureSnippet:
    """What a feature app served on this component needs (relay.features.ComponentPart)."""

    key: str
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class ConfigSnippets:
    prosody: str
    ejabberd: str
    features: tuple[FeatureSnippet, ...] = ()  # of the features this component serves


def config_snippets(*, component: Component, show_secret: bool) -> ConfigSnippets:
    """Prosody 0.12 and ejabberd 23.x configuration for this component.

    Without `show_secret` the secret is a placeholder: tenant staff never read it back.
    """
    secret = component.secret if show_secret else HIDDEN_SECRET
    jid, port = component.jid, component.port
    prosody = "\n".join(
        [
            "-- Global section: accept the push relay's component connection.",
            f"component_ports = {{ {port} }}",
            'component_interfaces = { "*" } -- or the one address the relay connects to',
            '-- Add "cloud_notify" (XEP-0357) to your modules_enabled list.',
            "",
            "-- At the end of the file:",
            f"Component {json.dumps(jid)}",
            f"    component_secret = {json.dumps(secret)}",
        ]
    )
    ejabberd = "\n".join(
        [
            "listen:",
            "  -",
            f"    port: {port}",
            '    ip: "::"',
            "    module: ejabberd_service",
            "    hosts:",
            f"      {json.dumps(jid)}:",
            f"        password: {json.dumps(secret)}",
            "",
            "modules:",
            "  mod_push: {}",
        ]
    )
    return ConfigSnippets(prosody=prosody, ejabberd=ejabberd, features=feature_snippets(component))


def feature_snippets(component: Component) -> tuple[FeatureSnippet, ...]:
    """The snippets of the feature apps this component serves, in INSTALLED_APPS order."""
    return tuple(
        FeatureSnippet(part.key, part.title, text)
        for part in features.component_parts()
        if (text := part.snippet(component))
    )
