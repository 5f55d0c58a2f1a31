"""The admin login's lockout, done by django-axes; this module is our whole adapter to it.

Why axes: the hand-written counter it replaces kept a lockout for the cache's default timeout
(an hour) instead of `LOGIN_LOCKOUT_SECONDS`, because `incr()` re-saves an entry, and its
per-address limit locked every admin out when all of them came through one proxy address.
Axes keeps attempts in the database (shared by every web process, whatever the cache), counts
them per *username and address pair* (`AXES_LOCKOUT_PARAMETERS` in settings), and lets a
lockout end exactly `LOGIN_LOCKOUT_SECONDS` after the failure that caused it.

Axes reads our settings through the three callables below (named in `pushsite/settings.py`), so
`RELAY["LOGIN_MAX_FAILURES"]`, `RELAY["LOGIN_LOCKOUT_SECONDS"]` and
`RELAY["TRUST_X_FORWARDED_FOR"]` stay the only knobs; the lockout page is
`relay.admin_site.locked_out`. Operators lift a lockout with axes' commands
(`manage.py axes_reset_username NAME`, `axes_reset_ip ADDRESS`, `axes_reset`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.http import HttpRequest

from relay import conf


def failure_limit(request: HttpRequest | None = None, credentials: Any = None) -> int:
    """Failed logins of one username from one address before that pair is locked out."""
    return max(1, conf.current().login_max_failures)


def cool_off(request: HttpRequest | None = None) -> timedelta:
    """How long a lockout lasts, counted from the failure that caused it."""
    return timedelta(seconds=max(1, conf.current().login_lockout_seconds))


def client_address(request: HttpRequest) -> str:
    """REMOTE_ADDR, or the proxy's view of the client when the proxy is trusted to say it.

    With `RELAY_TRUST_X_FORWARDED_FOR=1` the last X-Forwarded-For entry counts: the one our
    own proxy appended (anything left of it came from the client and may be forged).
    """
    if conf.current().trust_x_forwarded_for:
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
        entries = [entry.strip() for entry in forwarded.split(",") if entry.strip()]
        if entries:
            return entries[-1]
    return str(request.META.get("REMOTE_ADDR", ""))
