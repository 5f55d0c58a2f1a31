"""The security headers of every answer of the web process, computed in one place.

Django's middlewares add them to Django's answers (SecurityMiddleware, XFrameOptionsMiddleware,
django-csp's CSPMiddleware), but not every answer passes all of them: static files leave the
chain at WhiteNoise, before the last two, and the UnifiedPush resource answers on the event
loop without Django's request cycle. So the web server (pushsite/server.py) sets these on every
answer it writes, whatever route made it. What they are is asked of those same middlewares,
run once over an empty answer: Django's settings stay the one place that decides them, and no
route can differ from another.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.http import HttpRequest, HttpResponse
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.security import SecurityMiddleware

Headers = tuple[tuple[str, str], ...]

_computed: dict[bool, Headers] = {}


def _request(secure: bool) -> HttpRequest:
    request = HttpRequest()
    request.path = request.path_info = "/"
    proxy_header = settings.SECURE_PROXY_SSL_HEADER
    if secure and proxy_header:
        request.META[proxy_header[0]] = proxy_header[1]
    return request


def _compute(secure: bool) -> Headers:
    from csp.middleware import CSPMiddleware

    request = _request(secure)
    blank = HttpResponse()
    before = {name.lower() for name in blank.headers}
    response: Any = blank
    for middleware in (SecurityMiddleware, XFrameOptionsMiddleware, CSPMiddleware):
        response = middleware(lambda _request: blank).process_response(request, response)
    return tuple((name, value) for name, value in response.items() if name.lower() not in before)


def security_headers(secure: bool) -> Headers:
    """(name, value) of each header, for a request that came over HTTPS (`secure`) or not."""
    headers = _computed.get(secure)
    if headers is None:
        headers = _computed[secure] = _compute(secure)
    return headers


def is_secure(forwarded_proto: str | None) -> bool:
    """Whether Django takes a request with this proxy header (SECURE_PROXY_SSL_HEADER's) as
    HTTPS: the web server has no TLS of its own."""
    proxy_header = settings.SECURE_PROXY_SSL_HEADER
    if not proxy_header or forwarded_proto is None:
        return False
    request = HttpRequest()
    request.META[proxy_header[0]] = forwarded_proto
    return request.is_secure()


def proxy_header_name() -> str | None:
    """The HTTP name of SECURE_PROXY_SSL_HEADER (`X-Forwarded-Proto`), if one is set."""
    proxy_header = settings.SECURE_PROXY_SSL_HEADER
    if not proxy_header:
        return None
    return proxy_header[0].removeprefix("HTTP_").replace("_", "-").title()


def _forget(**_: Any) -> None:
    _computed.clear()


setting_changed.connect(_forget, dispatch_uid="pushsite.security.forget")
