"""The app a request names, kept per process and checked by each action's first statement."""

from __future__ import annotations

import re

from django.db import connection

from relay.models import App, Component
from relay.windows.services import sql
from relay.windows.services.errors import ErrorKind, UwpxError
from relay.windows.services.identifiers import APP_KEY_PATTERN

_APP_KEY = re.compile(APP_KEY_PATTERN)


def app_for_key(*, public_key: str) -> App:
    """The app named in the URL (or configured for the listener); refuses a suspended tenant.

    Kept per process once found, so a request costs no round trip of its own for its app.
    The actions' first statement checks that the app is still as kept (`sql.CURRENT`: same
    row, WNS credentials, tenant not suspended) and reads it afresh when not (`app_changed`),
    so a suspension or a new host list counts from the next request on. Only apps that exist
    are kept: no one can fill the memory with made-up keys."""
    app = _apps.get(public_key) if isinstance(public_key, str) else None
    return app if app is not None else load_app(public_key)


_apps: dict[str, App] = {}


def load_app(public_key: str) -> App:
    """One plain statement (the ORM would spend more building it than the database running
    it; credentials are not read: each one would be decrypted)."""
    if isinstance(public_key, str):
        _apps.pop(public_key, None)
    row = None
    if isinstance(public_key, str) and _APP_KEY.fullmatch(public_key):
        row = sql.fetchone(sql.APP_SQL, [public_key])
    if row is None:
        raise UwpxError(ErrorKind.UNKNOWN_APP, "Unknown app key.")
    if row[4]:
        raise UwpxError(ErrorKind.UNAVAILABLE, "This push service is suspended; try again later.")
    app = App.from_db(connection.alias, list(sql.APP_FIELDS), list(row[:3]))
    app.__dict__[_WNS_CREDENTIALS] = row[3]
    _apps[public_key] = app
    return app


# The kept app's WNS credentials record id, as `sql.CURRENT` compares it.
_WNS_CREDENTIALS = "_wns_credentials_id"


def app_params(app: App) -> list[object]:
    return [app.pk, app.tenant_id, app.public_key, app.__dict__.get(_WNS_CREDENTIALS, 0)]


def app_changed(app: App) -> App | None:
    """After a statement guarded by `sql.CURRENT` found nothing: the app as it is now when it
    changed (UwpxError when it is gone or suspended), None when it is as kept (so the row
    itself was missing)."""
    fresh = load_app(app.public_key)
    return None if app_params(fresh) == app_params(app) else fresh


class AppChanged(Exception):
    """The kept app no longer matches its row: the request runs again with the fresh one."""

    def __init__(self, app: App) -> None:
        super().__init__("app changed")
        self.app = app


def push_component(*, app: App) -> Component | None:
    """The component a Windows client enables push with: the app's first enabled one by id."""
    return Component.objects.filter(app=app, enabled=True).order_by("id").first()
