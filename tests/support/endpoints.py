"""A live UnifiedPush endpoint for a component, as the gateway hands one to a phone."""

from __future__ import annotations

import base64
import os
import time

from relay.models import Component
from relay.unifiedpush.services import registration


def new_endpoint(component: Component, jid: str = "someone@endpoints.example/phone") -> str:
    """The endpoint URL (`<base>/push/<token>`) of a fresh registration of `jid`."""
    return registration.register(
        component_id=component.pk,
        jid=jid,
        domain=jid.split("@")[1].split("/")[0],
        has_resource=True,
        application=base64.b64encode(os.urandom(32)).decode(),
        instance=base64.b64encode(os.urandom(32)).decode(),
        now=time.time(),
    ).endpoint
