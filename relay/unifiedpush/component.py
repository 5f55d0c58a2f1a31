"""UnifiedPush's part of a component (relay.features.ComponentPart): its settings row, its
section in `load_tenants`, and its snippet on the component's admin page."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError

from relay.models import Component
from relay.unifiedpush import endpoint_urls
from relay.unifiedpush.models import DEFAULT_TOKEN_LIFETIME_DAYS, ComponentSettings, settings_of

_KEYS = frozenset({"endpoint_url", "token_lifetime_days"})


class UnifiedPushPart:
    key = "unifiedpush"
    model = ComponentSettings
    related_name = "unifiedpush_settings"
    title = "UnifiedPush (reverse proxy, and what users set)"

    def provisioned(self, section: Any, where: str) -> dict[str, Any]:
        """`unifiedpush: {endpoint_url, token_lifetime_days}`."""
        if not isinstance(section, dict):
            raise ValueError(f"{where}: expected a mapping")
        unknown = sorted(set(section) - _KEYS)
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown key")
        url = section.get("endpoint_url")
        if url is None or url == "":
            raise ValueError(f"{where}.endpoint_url: required")
        if not isinstance(url, str):
            raise ValueError(f"{where}.endpoint_url: expected text")
        try:
            url = endpoint_urls.normalized(url)
        except ValidationError as error:
            raise ValueError(f"{where}.endpoint_url: {error.messages[0]}") from None
        days = section.get("token_lifetime_days", DEFAULT_TOKEN_LIFETIME_DAYS)
        if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= 365:
            raise ValueError(f"{where}.token_lifetime_days: expected a number of days, 1 to 365")
        return {"endpoint_url": url, "token_lifetime_days": days}

    def serves(self, component: Component) -> bool:
        return settings_of(component) is not None

    def snippet(self, component: Component) -> str:
        """What the operator's reverse proxy and the users need for UnifiedPush here."""
        settings = settings_of(component)
        if settings is None:
            return ""
        base = settings.endpoint_url.rstrip("/")
        days = settings.token_lifetime_days
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


part = UnifiedPushPart()
