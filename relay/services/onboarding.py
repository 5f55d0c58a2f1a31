"""What an operator needs to connect a tenant's XMPP server: a strong secret and its config.

The snippets are what the server's admin pastes into Prosody or ejabberd; the relay's gateway
then connects to `host:port` as the component and picks up the change within seconds.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

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
class ConfigSnippets:
    prosody: str
    ejabberd: str
    unifiedpush: str = ""  # empty when the component does not serve UnifiedPush


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
    return ConfigSnippets(
        prosody=prosody, ejabberd=ejabberd, unifiedpush=unifiedpush_snippet(component=component)
    )


def unifiedpush_snippet(*, component: Component) -> str:
    """What the operator's reverse proxy and the users need for UnifiedPush on this component."""
    if not component.serves_unifiedpush:
        return ""
    base = component.unifiedpush_endpoint_url.rstrip("/")
    days = component.unifiedpush_token_lifetime_days
    return "\n".join(
        [
            f"# Endpoints are {base}/push/<token> (valid {days} days, renewed by the phone);",
            f"# the Matrix push gateway is {base}/_matrix/push/v1/notify.",
            "# The reverse proxy in front of the relay's web process must pass these paths",
            "# (nginx; keep request bodies up to 4096 bytes for /push/):",
            "location /push/ { proxy_pass http://127.0.0.1:8000; client_max_body_size 8k; }",
            "location /_matrix/push/ { proxy_pass http://127.0.0.1:8000; }",
            "",
            "# Users: in Conversations, Settings > UnifiedPush distributor, choose the account",
            f"# and set the push server to {component.jid}. Their server needs no module for",
            "# this: it only routes the phone's register iq and our push iqs.",
        ]
    )
