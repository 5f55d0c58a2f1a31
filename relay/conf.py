"""The relay's configuration as one typed, frozen object: `current()`.

The variables, their types, defaults and meanings are declared once, in
`relay.environment.Environment`; pushsite/settings.py reads them, resolves the defaults that
depend on other values (files under VAR_DIR, the database's engine) and keeps the result in
`settings.RELAY` (upper-case names, so tests can override_settings a few of them). This
module types that again, so code reads attributes, never string keys, and cannot carry a
default of its own. Cross-setting rules are system checks (relay/checks.py).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

from relay.environment import CountPerSeconds, Environment, RateBurst

RelayConf = Environment
__all__ = ["CountPerSeconds", "RateBurst", "RelayConf", "build", "current"]


def build(source: Any = settings) -> Environment:
    """The typed view of `source.RELAY`; a name missing there takes its declared default."""
    return Environment.model_validate({name.lower(): value for name, value in source.RELAY.items()})


_current: Environment | None = None


def current() -> Environment:
    """The configuration now in force (built once, rebuilt after a setting changed)."""
    global _current
    conf = _current
    if conf is None:
        conf = _current = build()
    return conf


def _forget(**_: Any) -> None:
    global _current
    _current = None


setting_changed.connect(_forget, dispatch_uid="relay.conf.forget")
