"""Admin sessions that end: after RELAY_ADMIN_IDLE_SECONDS without a request, after
RELAY_ADMIN_SESSION_MAX_SECONDS in any case, and everywhere at once when a staff member (or
an operator acting on one) says so or one of their second factors is added or removed.

Works with any session backend: each session carries when it started, when it was last used
and its epoch; a user's `SessionEpoch.not_before` ends every session whose epoch is older.
(A password change already ends the user's other sessions: Django checks the password's hash
kept in each session.)
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from django.contrib.auth import logout
from django.http import HttpRequest

from relay import conf
from relay.operators.models import AuditAction, SessionEpoch
from relay.operators.services import audit

STARTED = "relay_session_started"
SEEN = "relay_session_seen"
EPOCH = "relay_session_epoch"
# The last-used time is rewritten at most this often (each rewrite saves the session).
SEEN_GRANULARITY = 15.0


def started(request: HttpRequest | None) -> None:
    """A login: the session's clocks start now."""
    if request is None or not hasattr(request, "session"):
        return
    now = time.time()
    request.session[STARTED] = now
    request.session[SEEN] = now
    request.session[EPOCH] = now


def expiry_reason(request: HttpRequest, user: Any, now: float | None = None) -> str:
    """Why the request's session is over ("" if it is not)."""
    now = time.time() if now is None else now
    session = request.session
    settings = conf.current()
    begun = float(session.get(STARTED, 0))
    if now - begun > settings.admin_session_max_seconds:
        return "session lifetime reached"
    if now - float(session.get(SEEN, 0)) > settings.admin_idle_seconds:
        return "idle timeout"
    not_before = (
        SessionEpoch.objects.filter(user_id=user.pk).values_list("not_before", flat=True).first()
    )
    if not_before is not None and float(session.get(EPOCH, 0)) < not_before.timestamp():
        return "sessions ended everywhere"
    return ""


def enforce(request: HttpRequest) -> bool:
    """End the request's session if it is over; True if it was ended."""
    user = request.user
    if not user.is_authenticated:
        return False
    reason = expiry_reason(request, user)
    if reason:
        request.relay_logout_reason = reason  # type: ignore[attr-defined]
        logout(request)
        return True
    now = time.time()
    if now - float(request.session.get(SEEN, 0)) >= SEEN_GRANULARITY:
        request.session[SEEN] = now
    return False


def end_everywhere(user: Any, *, keep: HttpRequest | None = None, reason: str) -> None:
    """End every session of `user`; the session of `keep` (the user's own) goes on."""
    now = datetime.now(UTC)
    SessionEpoch.objects.update_or_create(user=user, defaults={"not_before": now})
    if keep is not None and keep.user.is_authenticated and keep.user.pk == user.pk:
        keep.session[EPOCH] = now.timestamp()
    audit.record(AuditAction.SESSIONS_ENDED, obj=user, detail=reason)


def end_everywhere_for_device_change(user_id: int) -> None:
    """A second factor added or removed: the user's other sessions end."""
    from django.contrib.auth import get_user_model

    user = get_user_model()._default_manager.filter(pk=user_id).first()
    if user is None:
        return
    end_everywhere(user, keep=audit.current_request(), reason="second factor added or removed")
