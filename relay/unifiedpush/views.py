"""The UnifiedPush resource under Django's own server (`manage.py runserver`, a developer's
first habit): the same `relay.unifiedpush.http.PushResource` the web process serves on its
event loop (pushsite/server.py answers these paths before Django sees them), here on an event
loop of its own in a background thread, so the development server serves the whole site."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from relay.unifiedpush.http import PATHS, PushResource

_lock = threading.Lock()
_served: tuple[asyncio.AbstractEventLoop, PushResource] | None = None


def _resource() -> tuple[asyncio.AbstractEventLoop, PushResource]:
    """The process's loop and resource, started on the first request."""
    global _served
    with _lock:
        if _served is None:
            loop = asyncio.new_event_loop()
            threading.Thread(
                target=loop.run_forever, name="unifiedpush-resource", daemon=True
            ).start()

            async def made() -> PushResource:  # its connections belong to this loop
                return PushResource()

            _served = loop, asyncio.run_coroutine_threadsafe(made(), loop).result()
        return _served


@csrf_exempt  # an application server's POST carries no CSRF token: the token is the URL
def resource(request: HttpRequest) -> HttpResponse:
    path = request.path
    if not PATHS.fullmatch(path):
        raise Http404
    loop, push = _resource()
    header: Callable[[str], str | None] = request.headers.get
    answer = push.refusal(request.method or "GET", path, header)
    if answer is None:

        async def in_thread(work: Callable[[], Any]) -> Any:
            return await loop.run_in_executor(None, work)

        body = request.body[: push.max_body_bytes]
        answer = asyncio.run_coroutine_threadsafe(
            push.answer(request.method or "GET", path, header, body, in_thread), loop
        ).result()
    status, headers, content = answer
    response = HttpResponse(content, status=status)
    if not any(name.lower() == "content-type" for name, _ in headers):
        del response["Content-Type"]
    for name, value in headers:
        response[name] = value
    return response
