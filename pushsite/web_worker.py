"""gunicorn's worker for the web process: gthread, with UnifiedPush POSTs parsed in a few lines.

Why: a POST to an endpoint is the hot path, and gunicorn's HTTP/1.1 handling in Python (its
parser, the WSGI environ, its response object) cost as much CPU as the rest of the POST
(py-spy, bench/unifiedpush.py). This worker is gunicorn's `gthread` worker (same threads,
keep-alive, timeouts, graceful stop) whose request handler first looks at the bytes: a plain
`POST /push/v4.local.… HTTP/1.1` with a Content-Length and nothing unusual is answered here
by `relay.unifiedpush_http.post` (the function the WSGI fast path and the Django view call,
so the answers cannot differ), counted for /metrics and written to the access log like any
request. Everything else (other paths and methods, HTTP/1.0, chunked or oversized bodies,
`Expect`, odd header syntax, TLS, HTTP/2) is handed back to gunicorn untouched, with the
bytes already read, and goes through WSGI and Django as before.

Named in the Procfile, compose.yaml, the Dockerfile and the systemd unit with
`--worker-class pushsite.web_worker.PushWorker`.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import Any

from gunicorn.util import http_date
from gunicorn.workers.gthread import _DEFER, DEFAULT_WORKER_DATA_TIMEOUT, ThreadWorker

log = logging.getLogger("relay.unifiedpush_http")

PREFIX = b"POST /push/v4.local."
MAX_HEAD = 8192  # a longer head goes to gunicorn, which applies its own limits
MAX_BODY = 4096 + 1  # relay.services.unifiedpush.messages.MAX_BODY_BYTES, +1 to see excess
READ_TIMEOUT = 5.0  # a client that stalls mid-request loses the connection
_TOKEN_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_PATH = re.compile(rb"/push/(v4\.local\.[A-Za-z0-9_\-.]+)")
# Headers that change how the request is framed or answered: gunicorn's full parser decides.
_HAND_BACK = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"http2-settings"})
_REASONS = {
    201: b"Created",
    400: b"Bad Request",
    404: b"Not Found",
    411: b"Length Required",
    413: b"Content Too Large",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}


class _Date:
    """The Date header, formatted once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.value = http_date(second).encode()
            cls.second = second
        return cls.value


class _Request:
    """What the fast path read: enough for the answer, /metrics and the access log."""

    __slots__ = ("body", "close", "headers", "token")

    def __init__(self, token: str, headers: dict[str, str], body: bytes, close: bool) -> None:
        self.token = token
        self.headers = headers
        self.body = body
        self.close = close


def parse_head(head: bytes) -> tuple[str, dict[str, str], int, bool] | None:
    """(token, headers by lower-case name, content length, close) of a plain POST to an
    endpoint; None for anything gunicorn should see (its parser then decides)."""
    if head.count(b"\r") != head.count(b"\n"):  # bare CR or LF: not for a shortcut
        return None
    lines = head.split(b"\r\n")
    request_line = lines[0].split(b" ")
    if len(request_line) != 3 or request_line[2] != b"HTTP/1.1":
        return None
    match = _PATH.fullmatch(request_line[1])
    if match is None:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN_NAME.fullmatch(name):
            return None
        lower = name.lower()
        if lower in _HAND_BACK:
            return None
        try:
            text = value.strip(b" \t").decode("ascii")
        except UnicodeDecodeError:
            return None
        if not text.isprintable():
            return None
        key = lower.decode()
        if key in headers:
            if key in ("content-length", "host"):
                return None
            headers[key] += "," + text  # as a WSGI server joins repeated headers
        else:
            headers[key] = text
    length_text = headers.get("content-length")
    if length_text is None or not length_text.isdigit() or len(length_text) > 6:
        return None
    length = int(length_text)
    if length > MAX_BODY:
        return None
    close = "close" in headers.get("connection", "").lower()
    return match.group(1).decode(), headers, length, close


class _Response:
    """gunicorn's access log reads these attributes."""

    __slots__ = ("headers", "sent", "status")

    def __init__(self, status: int, headers: list[tuple[str, str]], sent: int) -> None:
        self.status = str(status)
        self.headers = headers
        self.sent = sent


class PushWorker(ThreadWorker):
    """gunicorn's gthread worker with the UnifiedPush POST shortcut (see the module)."""

    alive: bool  # gunicorn's base worker sets it

    def handle(self, conn: Any) -> Any:
        if self.cfg.is_ssl:
            return super().handle(conn)
        try:
            if not conn.initialized:  # as gunicorn's handle() starts a new connection
                if not conn.data_ready and not conn.wait_for_data(DEFAULT_WORKER_DATA_TIMEOUT):
                    return _DEFER
                conn.sock.setblocking(True)
                conn.init()
            if conn.is_http2:
                return super().handle(conn)
            outcome = self._fast(conn)
        except OSError:  # the client went away or stalled (TimeoutError too): close
            return False
        if outcome is not None:
            return outcome
        return super().handle(conn)

    def _fast(self, conn: Any) -> bool | None:
        """True/False (keep the connection or not) when answered here; None to hand the
        request to gunicorn, with whatever was read put back in front of its parser."""
        unreader = conn.parser.unreader
        if unreader.buf.tell() or unreader.buf.getvalue():
            return None  # read-ahead from gunicorn's side: let it go on
        sock = conn.sock
        # The poller said readable, so the first read returns at once whatever the socket's
        # mode (non-blocking on a kept-alive connection); only further reads get a timeout.
        try:
            data = sock.recv(MAX_HEAD + MAX_BODY)
        except BlockingIOError:
            return None  # nothing after all: gunicorn's handler waits as it always does
        if not data:
            return False
        if not data.startswith(PREFIX):
            unreader.unread(data)
            return None
        end = data.find(b"\r\n\r\n")
        if end < 0:
            sock.settimeout(READ_TIMEOUT)
            while end < 0 and len(data) < MAX_HEAD:
                more = sock.recv(MAX_HEAD + MAX_BODY)
                if not more:
                    return False
                data += more
                end = data.find(b"\r\n\r\n")
        parsed = parse_head(data[:end]) if end >= 0 else None
        if parsed is None:
            unreader.unread(data)
            return None
        token, headers, length, close = parsed
        body_end = end + 4 + length
        if len(data) < body_end:
            sock.settimeout(READ_TIMEOUT)
            while len(data) < body_end:
                more = sock.recv(body_end - len(data))
                if not more:
                    return False
                data += more
        if len(data) > body_end:
            unreader.unread(data[body_end:])  # a pipelined next request
        request = _Request(token, headers, data[end + 4 : body_end], close)
        return self._answer(conn, request)

    def _answer(self, conn: Any, request: _Request) -> bool:
        # Imported here: Django is set up only once gunicorn has loaded the application.
        from django.db import close_old_connections

        from relay import unifiedpush_http
        from relay.metrics import HTTP_DURATION, HTTP_REQUESTS

        started = time.perf_counter()
        body = request.body
        try:
            status, headers, content = unifiedpush_http.post(
                token=request.token,
                content_length=str(len(body)),
                transfer_encoding="",
                read=lambda size: body[:size],
                header=lambda name: request.headers.get(name.lower()),
            )
        except Exception as error:  # what Django would turn into a 500, logged without details
            log.exception("unifiedpush.post_crashed", extra={"error_type": type(error).__name__})
            status, headers, content = 500, [("Content-Type", "application/json")], b"{}"
        if status >= 500:
            close_old_connections()  # a dropped database connection is reopened next time
        self.nr += 1
        keep = not request.close and self.alive and bool(self.cfg.keepalive)
        if self.nr >= self.max_requests:
            if self.alive:
                self.log.info("Autorestarting worker after current request.")
                self.alive = False
            keep = False
        if len(self.keepalived_conns) >= self.max_keepalived:
            keep = False
        headers = [
            *headers,
            *unifiedpush_http.SECURITY_HEADERS,
            ("Content-Length", str(len(content))),
        ]
        head = [
            b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"")),
            b"Server: gunicorn",
            b"Date: " + _Date.now(),
            *(f"{name}: {value}".encode("latin-1") for name, value in headers),
        ]
        if not keep:
            head.append(b"Connection: close")
        payload = b"\r\n".join(head) + b"\r\n\r\n" + content
        try:
            sent = conn.sock.send(payload)
        except BlockingIOError:
            sent = 0
        if sent < len(payload):  # a full send buffer: wait for it, within the timeout
            conn.sock.settimeout(READ_TIMEOUT)
            conn.sock.sendall(payload[sent:])
        elapsed = time.perf_counter() - started
        HTTP_REQUESTS.labels("push", "POST", str(status)).inc()  # relay.metrics.http_handler
        HTTP_DURATION.labels("push").observe(elapsed)
        if self.log.access_log_enabled:
            self._access_log(conn, request, status, headers, len(payload), elapsed)
        return keep

    def _access_log(
        self,
        conn: Any,
        request: _Request,
        status: int,
        headers: list[tuple[str, str]],
        sent: int,
        elapsed: float,
    ) -> None:
        path = "/push/" + request.token
        client = conn.client
        environ = {
            "REQUEST_METHOD": "POST",
            "RAW_URI": path,
            "PATH_INFO": path,
            "QUERY_STRING": "",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": client[0] if isinstance(client, tuple) else str(client or ""),
            "HTTP_USER_AGENT": request.headers.get("user-agent", "-"),
            "HTTP_REFERER": request.headers.get("referer", "-"),
        }
        self.log.access(
            _Response(status, headers, sent),
            [(name.upper(), value) for name, value in request.headers.items()],
            environ,
            timedelta(seconds=elapsed),
        )
