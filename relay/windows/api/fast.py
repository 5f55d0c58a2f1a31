"""The Windows API's POSTs without Django's request cycle: answered as the ninja views answer.

Why: a Windows client's registration is two small POSTs, and in gunicorn Django's request
cycle (eleven middlewares, URL resolution) and ninja's parameter handling cost more CPU than
the registration itself (py-spy on the workers: about 45 % of a worker's time, against 25 %
for the work). `FastUwpxPath` wraps the WSGI application (pushsite/wsgi.py) like the
UnifiedPush fast path does, and answers `POST /api/v1/apps/<key>/uwpx[/<action>]` with the
same functions the views use (the guard, `protocol.dispatch`, the same error answers).

Only what it is sure of: a JSON body that validates against the URL's schema, from an allowed
Host. Anything else (a body that is not JSON, a message that does not validate, another
content type, a Host Django would refuse) goes on to Django, body included, so every error
text stays the views' own; the address limit is not counted twice for it.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

from django.core import signals
from django.core.exceptions import DisallowedHost
from django.core.handlers.wsgi import WSGIRequest
from django.db import DatabaseError
from django.http import HttpResponse
from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from relay.windows import services as uwpx
from relay.windows.api import protocol, views
from relay.windows.api.schemas import MESSAGE, RequestTestPush, SetAccounts, SetChannelUri
from relay.windows.services import UwpxError

log = logging.getLogger(__name__)

PATH = re.compile(r"^/api/v1/apps/([A-Za-z0-9_-]{1,64})/uwpx(?:/([a-z_]+))?/?$")
# The schema each URL takes, as the views declare it.
SCHEMAS: dict[str | None, TypeAdapter[Any]] = {
    None: MESSAGE,
    "set_channel_uri": TypeAdapter(SetChannelUri),
    "set_accounts": TypeAdapter(SetAccounts),
    "request_test_push": TypeAdapter(RequestTestPush),
}
# What Django's middleware adds to every answer (security and clickjacking); an API answer
# carries no markup, but it must not lose a header by taking the short way.
EXTRA_HEADERS = [
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "same-origin"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("X-Frame-Options", "DENY"),
]


class FastUwpxPath:
    """WSGI middleware: valid UWPX POSTs skip Django's request cycle (see the module)."""

    def __init__(self, application: Callable[..., Iterable[bytes]]) -> None:
        self.application = application

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        match = PATH.match(environ.get("PATH_INFO", ""))
        if (
            match is None
            or environ.get("REQUEST_METHOD") != "POST"
            or match.group(2) not in SCHEMAS
            or not environ.get("CONTENT_TYPE", "").startswith("application/json")
        ):
            return self.application(environ, start_response)
        # What Django's handler sends around a request (database connections past their age
        # or broken are closed, the cache's connections released); the test client turns
        # the connection part off, as for its own requests.
        signals.request_started.send(sender=self.__class__, environ=environ)
        try:
            response = self._answer(environ, match.group(1), match.group(2))
        finally:
            signals.request_finished.send(sender=self.__class__)
        if response is None:
            return self.application(environ, start_response)
        content = response.content
        headers = [*response.items(), *EXTRA_HEADERS, ("Content-Length", str(len(content)))]
        start_response(f"{response.status_code} {response.reason_phrase}", headers)
        return [content]

    def _answer(self, environ: dict[str, Any], app_key: str, action: str | None) -> Any:
        """The response, or None to hand the request on to Django (its input rewound)."""
        request = WSGIRequest(environ)
        try:
            request.get_host()
        except DisallowedHost:
            return None  # Django answers it (400) and logs it
        try:
            uwpx.check_address_rate(client_address=views.client_address(request))
            views._check_size(request)
        except UwpxError as error:
            return views.error_response(request, error)
        body = request.body
        # From here on, Django gets the request only with the body and the count done.
        environ["wsgi.input"] = io.BytesIO(body)
        environ[views.GUARDED] = True
        try:
            message = SCHEMAS[action].validate_python(json.loads(body))
        except (ValueError, RecursionError, PydanticValidationError):
            return None  # not JSON or not valid: the views' own error texts
        try:
            answer = protocol.dispatch(app=uwpx.app_for_key(public_key=app_key), message=message)
        except UwpxError as error:
            return views.error_response(request, error)
        except DatabaseError as error:
            log.warning("api.database_unavailable", extra={"error_type": type(error).__name__})
            return views.error_response(
                request, UwpxError(uwpx.ErrorKind.UNAVAILABLE, protocol.UNAVAILABLE)
            )
        except Exception as error:
            log.exception("api.internal_error", extra={"error_type": type(error).__name__})
            return HttpResponse(
                json.dumps(protocol.error_body(protocol.INTERNAL_ERROR)),
                status=500,
                content_type="application/json; charset=utf-8",
            )
        return views.api.create_response(request, answer, status=200)
