"""Django (any WSGI application) served from the web process's event loop: aiohttp has no
WSGI container, so this is ours, and small.

The request's body is read whole on the loop (within WEB_MAX_BODY_BYTES) before the
application runs; the application then runs on a thread of the bounded pool, in one job:
the call, `start_response`, iterating its result and `close()` (PEP 3333). The answer comes
back whole (status, headers, body) and the server writes it: Django's answers here are
pages, JSON and the admin's static files, never a stream.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from io import BytesIO
from types import TracebackType
from typing import Any
from urllib.parse import unquote_to_bytes

WsgiApplication = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
# (status, reason, headers, body)
WsgiAnswer = tuple[int, str, list[tuple[str, str]], bytes]


def environ(
    *,
    method: str,
    target: str,
    version: str,
    headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
    remote: str,
    server: tuple[str, int],
    multiprocess: bool,
    authority: str | None = None,
) -> dict[str, Any]:
    """The WSGI environ of one request (PEP 3333). `target` is the request target in origin
    form, percent-encoded as it came; PATH_INFO is its path decoded to bytes and carried as
    latin-1, as the PEP asks. `headers` are the fields as they came (bytes), carried as
    latin-1 strings too, so any byte a client sends reaches Django as the same byte (a
    UTF-8 cookie is no error). Header fields whose names hold an underscore are dropped (as
    gunicorn and Django's runserver do): `X_Forwarded_Proto` must not pass for
    `X-Forwarded-Proto`. `authority`: the host of an absolute-form target, which replaces
    the Host field (RFC 9112 3.2.2)."""
    # aiohttp decodes the target as UTF-8 with surrogateescape: these are its bytes again.
    path, _, query = target.encode("utf-8", "surrogateescape").partition(b"?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": "",
        "PATH_INFO": unquote_to_bytes(path).decode("latin-1"),
        "QUERY_STRING": query.decode("latin-1"),
        "REMOTE_ADDR": remote,
        "SERVER_NAME": server[0],
        "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": version,
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",  # TLS ends at the proxy (SECURE_PROXY_SSL_HEADER)
        "wsgi.input": BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": multiprocess,
        "wsgi.run_once": False,
    }
    for raw_name, raw_value in headers:
        if b"_" in raw_name:
            continue
        name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
        key = name.upper().replace("-", "_")
        if key == "CONTENT_TYPE" or key == "CONTENT_LENGTH":
            environ[key] = value
            continue
        key = "HTTP_" + key
        if key in environ:  # a repeated field: one value, comma-separated (RFC 9110)
            environ[key] += "," + value
        else:
            environ[key] = value
    if authority is not None:
        environ["HTTP_HOST"] = authority
    if "CONTENT_LENGTH" not in environ and body:  # a chunked body, read whole
        environ["CONTENT_LENGTH"] = str(len(body))
    return environ


def run(application: WsgiApplication, environ: dict[str, Any]) -> WsgiAnswer:
    """Call the application and collect its answer; on a pool thread (it blocks)."""
    started: list[tuple[str, list[tuple[str, str]]]] = []
    chunks: list[bytes] = []

    def start_response(
        status: str, headers: list[tuple[str, str]], exc_info: ExcInfo | None = None
    ) -> Callable[[bytes], None]:
        # Nothing is sent before the application returns, so a second call with exc_info
        # (an error page after all) replaces the first (PEP 3333); without it, it is a bug.
        if started and exc_info is None:
            raise AssertionError("start_response called twice without exc_info")
        started[:] = [(status, headers)]
        return chunks.append

    result = application(environ, start_response)
    try:
        for chunk in result:
            if chunk:
                chunks.append(chunk)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    if not started:
        raise RuntimeError("the WSGI application did not call start_response")
    status, headers = started[0]
    code, _, reason = status.partition(" ")
    return int(code), reason, headers, b"".join(chunks)
