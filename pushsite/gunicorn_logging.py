"""gunicorn's logger without UnifiedPush capabilities in the access log.

An endpoint URL (`/push/<token>`) lets whoever holds it push to a phone, and a message
resource (`/push/message/<reference>`) lets them withdraw a message: the access log keeps the
path's shape and drops those parts. pushsite/gunicorn_conf.py names it (`logger_class`).
"""

from __future__ import annotations

import re
from typing import Any

from gunicorn.glogging import Logger as GunicornLogger

SECRET_PATH = re.compile(r"(/push/(?:message/)?)[^\s/?\"]+")


class Logger(GunicornLogger):
    def atoms(self, resp: Any, req: Any, environ: dict[str, Any], request_time: Any) -> dict:
        atoms = super().atoms(resp, req, environ, request_time)
        for key, value in atoms.items():
            if isinstance(value, str) and "/push/" in value:
                atoms[key] = SECRET_PATH.sub(r"\1…", value)
        return atoms
