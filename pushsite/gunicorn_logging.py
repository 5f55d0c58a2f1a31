"""gunicorn's logger without UnifiedPush capabilities in its lines.

An endpoint URL (`/push/<token>`) lets whoever holds it push to a phone, and a message
resource (`/push/message/<reference>`) lets them withdraw a message. gunicorn writes request
paths in the access log and in its error log ("Error handling request /push/…", "Invalid
request from …"): both loggers get the filter Django's loggers have
(`relay.logging.MaskSecrets`), so every line keeps the path's shape and drops those parts.
pushsite/gunicorn_conf.py names it (`logger_class`).
"""

from __future__ import annotations

from typing import Any

from gunicorn.glogging import Logger as GunicornLogger

from relay.logging import MaskSecrets


class Logger(GunicornLogger):
    def setup(self, cfg: Any) -> None:
        super().setup(cfg)  # run again on a configuration reload: add the filter once
        for logger in (self.error_log, self.access_log):
            if not any(isinstance(each, MaskSecrets) for each in logger.filters):
                logger.addFilter(MaskSecrets())
