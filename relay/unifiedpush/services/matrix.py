"""The Matrix push gateway (`POST /_matrix/push/v1/notify`), as ntfy and UnifiedPush's
common-proxies offer it: a homeserver pushes to a pusher whose `pushkey` is one of our
endpoint URLs, and we relay the notification to that endpoint like any POST.

Each device gets `{"notification": {..., "devices": [that device]}}` as its message body
(without `content` and the other optional fields when the whole would exceed 4096 bytes).
Pushkeys that are not live endpoints (malformed, tampered, expired, revoked, component gone)
come back in `rejected`, so the homeserver deletes those pushers. A device that hits a
temporary limit (429, 503) makes the whole request fail with that status: the homeserver
retries it later (other devices of the request may then get the message twice, never zero
times).
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit

from relay.unifiedpush.models import UnifiedPushUrgency
from relay.unifiedpush.services import messages
from relay.unifiedpush.services.messages import MAX_BODY_BYTES, NOT_FOUND, PushRefused

MAX_REQUEST_BYTES = 64 * 1024
MAX_DEVICES = 100
_KEPT_WHEN_TRIMMED = ("event_id", "room_id", "counts", "prio")


class BadNotification(ValueError):
    """The request is not a Matrix push notification."""


def _token_of(pushkey: str) -> str:
    path = urlsplit(pushkey).path
    head, _, token = path.rpartition("/")
    if not head.endswith("/push") or not token:
        raise PushRefused(NOT_FOUND, "not an endpoint")
    return token


def _body(notification: dict[str, Any], device: dict[str, Any]) -> bytes:
    full = {key: value for key, value in notification.items() if key != "devices"}
    full["devices"] = [device]
    body = json.dumps({"notification": full}, separators=(",", ":")).encode()
    if len(body) <= MAX_BODY_BYTES:
        return body
    trimmed = {key: full[key] for key in _KEPT_WHEN_TRIMMED if key in full}
    trimmed["devices"] = [{key: device[key] for key in ("app_id", "pushkey") if key in device}]
    body = json.dumps({"notification": trimmed}, separators=(",", ":")).encode()
    if len(body) <= MAX_BODY_BYTES:
        return body
    trimmed.pop("devices")
    return json.dumps({"notification": trimmed}, separators=(",", ":")).encode()[:MAX_BODY_BYTES]


def notify(document: Any, *, now: float | None = None) -> list[str]:
    """Relay to every device; return the rejected pushkeys."""
    if not isinstance(document, dict) or not isinstance(document.get("notification"), dict):
        raise BadNotification('expected {"notification": {...}}')
    notification = document["notification"]
    devices = notification.get("devices")
    if not isinstance(devices, list) or not devices or len(devices) > MAX_DEVICES:
        raise BadNotification(f"expected 1 to {MAX_DEVICES} devices")
    now = time.time() if now is None else now
    urgency = (
        UnifiedPushUrgency.LOW.label
        if notification.get("prio") == "low"
        else UnifiedPushUrgency.HIGH.label
    )
    # Every device checked and its body built before any is relayed: a bad one refuses the
    # request whole, never after part of it was stored.
    bodies: list[tuple[str, bytes]] = []
    for device in devices:
        if not isinstance(device, dict) or not isinstance(device.get("pushkey"), str):
            raise BadNotification("every device needs a pushkey")
        try:
            bodies.append((device["pushkey"], _body(notification, device)))
        except RecursionError:  # json's depth is within the stack, not once wrapped
            raise BadNotification("nested too deeply") from None
    rejected: list[str] = []
    temporary: PushRefused | None = None
    for pushkey, body in bodies:
        try:
            messages.accept(
                token=_token_of(pushkey),
                body=body,
                ttl=None,
                topic=None,
                urgency=urgency,
                now=now,
            )
        except PushRefused as refusal:
            if refusal.status == NOT_FOUND:
                rejected.append(pushkey)
            elif refusal.status in (429, 503):
                temporary = temporary or refusal
            else:  # 400 or 413 cannot happen for a body we built; never reject a pushkey for it
                temporary = temporary or PushRefused(503, refusal.reason, retry_after=5)
    if temporary is not None:
        raise temporary
    return rejected
