"""gunicorn's worker for the web process: gthread, with UnifiedPush POSTs parsed in a few lines.

Why: a POST to an endpoint is the hot path, and gunicorn's HTTP/1.1 handling in Python (its
parser, the WSGI environ, its response object) cost as much CPU as the rest of the POST
(py-spy, bench/unifiedpush.py). This worker is gunicorn's `gthread` worker (same threads,
keep-alive, timeouts, graceful stop) whose request handler first looks at the bytes: a plain
`POST /push/v4.local.… HTTP/1.1` with a Content-Length and nothing unusual is answered here
by `relay.unifiedpush.http.post` (the function the WSGI fast path and the Django view call,
so the answers cannot differ), counted for /metrics and written to the access log like any
request. Everything else (other paths and methods, HTTP/1.0, chunked or oversized bodies,
`Expect`, odd header syntax, TLS, HTTP/2) is handed back to gunicorn untouched, with the
bytes already read, and goes through WSGI and Django as before.

Named in the Procfile, compose.yaml, the Dockerfile and the systemd unit with
`--worker-class pushsite.web_worker.PushWorker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from gunicorn.util import http_date
from gunicorn.workers.gthread import _DEFER, DEFAULT_WORKER_DATA_TIMEOUT, ThreadWorker

log = logging.getLogger("relay.unifiedpush.http")

PREFIX = b"POST /push/v4.local."
_ADOPTED = object()  # handle()'s answer for a connection the push loop took over
MAX_HEAD = 8192  # a longer head goes to gunicorn, which applies its own limits
MAX_BODY = 4096 + 1  # relay.unifiedpush.services.messages.MAX_BODY_BYTES, +1 to see excess
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
    push_loop: PushLoop | None = None

    def init_process(self) -> None:
        if not self.cfg.is_ssl:
            self.push_loop = PushLoop(self)
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        # The application and everything it loaded live as long as the worker: left out of
        # the collector's full passes, which otherwise stall every thread now and then.
        gc.freeze()

    def finish_request(self, conn: Any, fs: Any) -> None:
        if not fs.cancelled() and fs.exception() is None and fs.result() is _ADOPTED:
            return  # the push loop has it now, and gives it back or closes it
        super().finish_request(conn, fs)

    def connection_done(self) -> None:
        """An adopted connection closed (called on gunicorn's main thread)."""
        self.nr_conns -= 1

    def give_back(self, conn: Any) -> None:
        """An adopted connection whose next request is not a plain POST to an endpoint:
        gunicorn's machinery takes it from here (called on gunicorn's main thread)."""
        self.enqueue_req(conn)

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

    def _answer(self, conn: Any, request: _Request) -> Any:
        # Imported here: Django is set up only once gunicorn has loaded the application.
        from relay.unifiedpush import http as unifiedpush_http

        started = time.perf_counter()
        body = request.body
        status, headers, content = self._guarded(
            lambda: unifiedpush_http.post(
                token=request.token,
                content_length=str(len(body)),
                transfer_encoding="",
                read=lambda size: body[:size],
                header=lambda name: request.headers.get(name.lower()),
            )
        )
        keep = self._keep(request)
        status, payload, headers = self._render(status, headers, content, keep)
        try:
            sent = conn.sock.send(payload)
        except BlockingIOError:
            sent = 0
        if sent < len(payload):  # a full send buffer: wait for it, within the timeout
            conn.sock.settimeout(READ_TIMEOUT)
            conn.sock.sendall(payload[sent:])
        self._record(conn, request, status, headers, len(payload), started)
        if keep and self.push_loop is not None and not conn.parser.unreader.buf.getvalue():
            # Its next POSTs are served by the event loop, without a thread each.
            self.push_loop.adopt(conn)
            return _ADOPTED
        return keep

    def _guarded(self, answer: Any) -> tuple[int, list[tuple[str, str]], bytes]:
        from django.db import close_old_connections

        from relay.unifiedpush import http as unifiedpush_http

        try:
            status, headers, content = answer()
        except Exception as error:  # what Django would turn into a 500
            status, headers, content = unifiedpush_http.crashed(error)
        if status >= 500:
            close_old_connections()  # a dropped database connection is reopened next time
        return status, headers, content

    def _keep(self, request: _Request) -> bool:
        self.nr += 1
        keep = not request.close and self.alive and bool(self.cfg.keepalive)
        if self.nr >= self.max_requests:
            if self.alive:
                self.log.info("Autorestarting worker after current request.")
                self.alive = False
            keep = False
        if len(self.keepalived_conns) >= self.max_keepalived:
            keep = False
        return keep

    def _render(
        self, status: int, headers: list[tuple[str, str]], content: bytes, keep: bool
    ) -> tuple[int, bytes, list[tuple[str, str]]]:
        """(status, bytes, headers) of the answer; a 500 if a header cannot be sent."""
        from relay.unifiedpush import http as unifiedpush_http

        status, headers, content = unifiedpush_http.sendable((status, headers, content))
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
        return status, b"\r\n".join(head) + b"\r\n\r\n" + content, headers

    def _record(
        self,
        conn: Any,
        request: _Request,
        status: int,
        headers: list[tuple[str, str]],
        sent: int,
        started: float,
    ) -> None:
        from relay.metrics import HTTP_DURATION, HTTP_REQUESTS

        elapsed = time.perf_counter() - started
        HTTP_REQUESTS.labels("push", "POST", str(status)).inc()  # relay.metrics.http_handler
        HTTP_DURATION.labels("push").observe(elapsed)
        if self.log.access_log_enabled:
            self._access_log(conn, request, status, headers, sent, elapsed)

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


class PushLoop:
    """Kept-alive connections that POST to endpoints, served by one event loop in a thread of
    the worker, with the direct path's connection to the gateway shared by all of them.

    Why: a POST waits for the phone (the direct path), and in gthread a waiting request holds
    a thread, and every request passes between the main thread and a pool thread (futures, a
    wake-up pipe, poller registrations, GIL hand-offs). That machinery cost more CPU than the
    POST itself (bench/unifiedpush.py, per-process CPU and py-spy). A connection is adopted
    after its first POST was answered the usual way; whatever is not a plain POST to an
    endpoint goes back to gunicorn with the bytes read. What may wait for the database (a
    cold cache, storing a message) runs on the worker's thread pool.
    """

    def __init__(self, worker: PushWorker) -> None:
        self.worker = worker
        self.loop = asyncio.new_event_loop()
        self.connections: set[_Adopted] = set()
        self.channels: Any = None
        self._thread = threading.Thread(target=self._run, name="push-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._tick)
        self.loop.run_forever()

    def adopt(self, conn: Any) -> None:
        """Called from a pool thread once the connection's answer was sent."""
        self.loop.call_soon_threadsafe(self._adopt, conn)

    def _adopt(self, conn: Any) -> None:
        adopted = _Adopted(self, conn)
        self.connections.add(adopted)
        adopted.start()

    def _tick(self) -> None:
        """Once a second: idle and stalled connections close, and all idle ones when the
        worker stops."""
        now = time.monotonic()
        keepalive = float(self.worker.cfg.keepalive or 0)
        for adopted in list(self.connections):
            if adopted.busy:
                continue
            if (
                not self.worker.alive
                or (not adopted.buffer and now - adopted.since > keepalive)
                or (adopted.buffer and now - adopted.since > READ_TIMEOUT)
            ):
                adopted.close()
        self.loop.call_later(1.0, self._tick)

    async def post(self, request: _Request) -> tuple[int, list[tuple[str, str]], bytes]:
        from relay import conf
        from relay.unifiedpush import http as unifiedpush_http
        from relay.unifiedpush.services.channel import AsyncChannels

        if self.channels is None:
            self.channels = AsyncChannels(window=conf.current().unifiedpush_direct_seconds)
        body = request.body
        return await unifiedpush_http.post_in_loop(
            token=request.token,
            body=body,
            header=lambda name: request.headers.get(name.lower()),
            channels=self.channels,
            in_thread=self._in_thread,
        )

    async def _in_thread(self, answer: Any) -> tuple[int, list[tuple[str, str]], bytes]:
        future = self.worker.tpool.submit(self.worker._guarded, answer)
        result: tuple[int, list[tuple[str, str]], bytes] = await asyncio.wrap_future(future)
        return result


class _Adopted:
    """One adopted connection: requests are read and answered one at a time, in order."""

    def __init__(self, owner: PushLoop, conn: Any) -> None:
        self.owner = owner
        self.conn = conn
        self.sock = conn.sock
        self.buffer = b""
        self.busy = False
        self.closed = False
        self.since = time.monotonic()
        self._unsent = b""

    def start(self) -> None:
        self.sock.setblocking(False)
        with contextlib.suppress(OSError):  # an answer never waits for the previous one's ACK
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.owner.loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data = self.sock.recv(MAX_HEAD + MAX_BODY)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        if not self.buffer:
            self.since = time.monotonic()
        self.buffer += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        data = self.buffer
        if not data:
            return
        if not (data.startswith(PREFIX) or (len(data) < len(PREFIX) and PREFIX.startswith(data))):
            self._give_back()
            return
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) >= MAX_HEAD:
                self._give_back()
            return  # the rest of the head is on its way
        parsed = parse_head(data[:end])
        if parsed is None:
            self._give_back()
            return
        token, headers, length, close = parsed
        body_end = end + 4 + length
        if len(data) < body_end:
            return  # the rest of the body is on its way
        self.buffer = data[body_end:]
        self.busy = True
        request = _Request(token, headers, data[end + 4 : body_end], close)
        self.owner.loop.create_task(self._serve(request))

    async def _serve(self, request: _Request) -> None:
        from relay.unifiedpush import http as unifiedpush_http

        worker = self.owner.worker
        started = time.perf_counter()
        try:
            status, headers, content = await self.owner.post(request)
        except Exception as error:  # what Django would turn into a 500
            status, headers, content = unifiedpush_http.crashed(error)
        if self.closed:
            return  # the client went away; the message was handled all the same
        try:
            keep = worker._keep(request)
            status, payload, headers = worker._render(status, headers, content, keep)
            self._send(payload)
            worker._record(self.conn, request, status, headers, len(payload), started)
        except Exception as error:  # never leave the connection waiting: end it
            log.exception("unifiedpush.answer_failed", extra={"error_type": type(error).__name__})
            self.close()
            return
        self.busy = False
        self.since = time.monotonic()
        if not keep:
            self._close_after_send()
        elif self.buffer and not self._unsent:
            self._next()

    def _send(self, payload: bytes) -> None:
        try:
            sent = self.sock.send(payload)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(payload):  # a full send buffer: the rest when the socket can take it
            self._unsent = payload[sent:]
            self.owner.loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        self._unsent = self._unsent[sent:]
        if not self._unsent:
            self.owner.loop.remove_writer(self.sock.fileno())
            if self.closed:
                self._release()
            elif self.buffer and not self.busy:
                self._next()

    def _close_after_send(self) -> None:
        if self._unsent:
            self.closed = True  # released once the answer is out
            self.owner.loop.remove_reader(self.sock.fileno())
            self.owner.connections.discard(self)
        else:
            self.close()

    def _detach(self) -> None:
        self.closed = True
        self.owner.connections.discard(self)
        self.owner.loop.remove_reader(self.sock.fileno())
        if self._unsent:
            self.owner.loop.remove_writer(self.sock.fileno())

    def _give_back(self) -> None:
        """Not a plain POST to an endpoint: gunicorn reads it, starting with what we read."""
        self._detach()
        self.sock.setblocking(True)
        self.conn.parser.unreader.unread(self.buffer)
        self.buffer = b""
        self.owner.worker.method_queue.defer(self.owner.worker.give_back, self.conn)

    def close(self) -> None:
        if self.closed and not self._unsent:
            return
        self._detach()
        self._release()

    def _release(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        self.owner.worker.method_queue.defer(self.owner.worker.connection_done)
