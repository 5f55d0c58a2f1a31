"""Structured (JSON) log lines. Callers pass facts as `extra`; never JIDs, tokens or bodies.

UnifiedPush endpoint tokens are capabilities (whoever holds one can push to a phone) and
arrive in request paths, which web servers and Django log (request lines, "Not Found: …",
"Method Not Allowed: …", the web server's access log and aiohttp's own lines). `mask_secrets`
is the one rule that removes them, applied by every log that may see a path: our formatter,
and the filter on Django's request loggers, the access log and aiohttp's loggers
(settings.LOGGING).
"""

from __future__ import annotations

import json
import logging
import logging.config
import re
import warnings
from typing import Any, TextIO

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
# Attached by Django to its request records (the request, or runserver's socket): its repr
# names the path, and nothing in it is a fact worth a log line.
_NOT_FACTS = frozenset({"request"})

MASK = "…"


# A percent-encoded character, possibly encoded again (`%252F` is `%2F` once decoded, `/`
# twice): clients and proxies decode a different number of times than the logs do.
_PERCENT = "%(?:25)*"


def _either(text: str) -> str:
    """`text` with any of its characters possibly percent-encoded, once or more
    (case-insensitive)."""
    return "".join(f"(?:{re.escape(char)}|{_PERCENT}{ord(char):02x})" for char in text)


_SLASHES = rf"(?:/|{_PERCENT}2f)+"
# A path under /push/ however written (repeated slashes, percent-encoding, a query): all of
# it after /push/ (and message/) is the token or reference. The Matrix gateway's
# /_matrix/push/v1/notify names nothing secret.
_PUSH_PATH = re.compile(
    rf"(?<!_matrix){_SLASHES}{_either('push')}{_SLASHES}"
    rf"(?P<message>{_either('message')}{_SLASHES})?[^\s\"'<>]+",
    re.IGNORECASE,
)
# A PASETO token anywhere (a header, a query, a message): version, purpose, payload.
_DOT = rf"(?:\.|{_PERCENT}2e)"
_PASETO = re.compile(rf"v[1-4]{_DOT}(?:local|public){_DOT}[A-Za-z0-9_\-.%]+", re.IGNORECASE)


def _masked_path(match: re.Match[str]) -> str:
    return "/push/message/" + MASK if match.group("message") else "/push/" + MASK


def mask_secrets(text: str) -> str:
    """`text` with UnifiedPush tokens and message references replaced by `…`."""
    escaped = "%" in text
    if escaped or "/" in text:
        text = _PUSH_PATH.sub(_masked_path, text)
    if escaped or "." in text:
        text = _PASETO.sub(MASK, text)
    return text


def _masked(value: object) -> object:
    if isinstance(value, str):
        return mask_secrets(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_masked(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _masked(item) for key, item in value.items()}
    return mask_secrets(str(value))


class MaskSecrets(logging.Filter):
    """A record's message (and traceback) masked before any handler sees it: on loggers
    whose records name request paths, whatever handler an operator adds."""

    _tracebacks = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: the handler reports it, with nothing formatted
            return True
        record.msg, record.args = mask_secrets(message), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = self._tracebacks.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask_secrets(record.exc_text)
        if record.stack_info:
            record.stack_info = mask_secrets(record.stack_info)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "event": mask_secrets(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in _NOT_FACTS and not key.startswith("_"):
                entry[key] = _masked(value)
        if record.exc_info:
            entry["exc_type"] = record.exc_info[0].__name__ if record.exc_info[0] else None
        return json.dumps(entry, default=str)


def configure(config: dict[str, Any]) -> None:
    """settings.LOGGING_CONFIG: the dictionary configuration, and Python's warnings as log
    lines of `py.warnings` (JSON like every other line; Django leaves them raw on stderr)."""
    logging.config.dictConfig(config)
    warnings.showwarning = _log_warning


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    if file is not None:  # written to a stream someone chose, as Python would
        file.write(warnings.formatwarning(message, category, filename, lineno, line))
        return
    logging.getLogger("py.warnings").warning(
        "%s: %s", category.__name__, message, extra={"where": f"{filename}:{lineno}"}
    )
