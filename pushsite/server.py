"""The web process: `python -m pushsite.server`.

aiohttp's low-level HTTP/1.1 server (`aiohttp.web.Server`, its public interface), in
WEB_WORKERS processes forked from this one, each with one event loop (uvloop) and a pool of
WEB_THREADS threads:

- the paths a feature app's web resource takes (relay.features: `web_resources`; UnifiedPush's
  `/push/…` and `/_matrix/push/v1/notify`) go to it on the event loop: a POST waiting for the
  phone holds no thread;
- everything else goes to Django (pushsite/wsgi.py) through our WSGI bridge
  (pushsite/wsgi_bridge.py), on the thread pool.

Every answer, whichever route made it, passes one place (`Site.send`): the security headers
Django's settings call for (pushsite/security.py), the access log line (masked), the request
counted for /metrics. Why aiohttp, and what each limit does: docs/web.md. aiohttp bounds
each field of a head (its parser's limits) and the wait for a head (its keep-alive timeout);
what it leaves to us is here: the head's bytes bounded while it is read, nothing more read of
a connection while one of its requests is answered (so what one connection holds is bounded),
the connection cap, the request line's length, the number of header fields and the head's
bytes answered 414 or 431 with our headers, the body's deadline, the flush deadline and its
hard close (one sweep over the connections), and a graceful stop (answer what is held, then
close).

This process binds the socket and supervises the workers: it starts them, starts another
when one dies (its live gauges are marked dead for /metrics), and on SIGTERM or SIGINT passes
the signal on and waits for them. In prometheus_client's multiprocess mode each worker keeps
its values in files under WEB_METRICS_DIR (emptied at start; by default a temporary directory
removed at exit), and any worker's /metrics adds up all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import resource
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote

import uvloop
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from pushsite import wsgi_bridge

log = logging.getLogger("pushsite.server")
access_log = logging.getLogger("pushsite.access")

Answer = tuple[int, list[tuple[str, str]], bytes]
Header = Callable[[str], str | None]
InThread = Callable[[Callable[[], Any]], Awaitable[Any]]
# prometheus_client's own variable: set here for the workers, never read from the operator's
# environment (.env.example: WEB_METRICS_DIR).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
SWEEP_SECONDS = 0.5
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What a header may be on the wire (RFC 9110: a token; visible ASCII, spaces and tabs).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[ \t\x21-\x7e]*")
_TEXT = ("Content-Type", "text/plain")
# An absolute-form request target (RFC 9112 3.2.2): scheme and authority, then the rest.
_ABSOLUTE = re.compile(r"[hH][tT][tT][pP][sS]?://([^/?#]*)")
# aiohttp writes a Server header unless one is set: this one names no version.
_SERVER = ("Server", "push-relay")


@dataclass(frozen=True, slots=True)
class Limits:
    """What one connection may take of a worker (docs/configuration.md: WEB_*)."""

    max_head_bytes: int
    max_headers: int
    max_request_line: int
    max_body_bytes: int
    head_seconds: float
    body_seconds: float
    flush_seconds: float
    graceful_seconds: float
    max_connections: int = 1000

    @classmethod
    def from_conf(cls) -> Limits:
        from relay import conf

        current = conf.current()
        return cls(
            max_head_bytes=current.web_max_head_bytes,
            max_headers=current.web_max_headers,
            max_request_line=current.web_max_request_line,
            max_body_bytes=current.web_max_body_bytes,
            head_seconds=current.web_head_seconds,
            body_seconds=current.web_body_seconds,
            flush_seconds=current.web_flush_seconds,
            graceful_seconds=current.web_graceful_seconds,
            max_connections=connection_cap(current.web_max_connections),
        )

    def parser_options(self) -> dict[str, Any]:
        """aiohttp's own limits, which stop its parser reading a head: a target or a field
        longer than the whole head may be, or twice the fields allowed. Within them the head
        is parsed and `Site.limit_refusal` answers what the configured limits refuse (414,
        431 with our headers, on HTTP/1.1); beyond them aiohttp refuses (`handle_error`).
        The head's bytes are bounded while it is read by `Connection.feed`."""
        return {
            "max_line_size": self.max_head_bytes,
            "max_field_size": self.max_head_bytes,
            "max_headers": 2 * self.max_headers,
            # The wait for a head: on a new connection, and after each answer.
            "keepalive_timeout": self.head_seconds,
            # A body left unread by a refusal from the head (413, 411) is read and dropped
            # by `Site._drop_body` (within the body's limits); aiohttp's own lingering read,
            # which comes after, then finds it read.
            "lingering_time": self.body_seconds,
        }


class Resource(Protocol):
    """A route served on the event loop, for the paths `paths` matches whole (a feature
    app's, relay.features.WebResource)."""

    paths: re.Pattern[str]
    max_body_bytes: int

    def refusal(self, method: str, path: str, header: Header) -> Answer | None: ...

    async def answer(
        self, method: str, path: str, header: Header, body: bytes, in_thread: InThread
    ) -> Answer: ...


def _sendable(headers: Iterable[tuple[str, str]]) -> bool:
    return all(_HEADER_NAME.fullmatch(name) and _HEADER_VALUE.fullmatch(value)
               for name, value in headers)  # fmt: skip


def origin_form(target: str) -> tuple[str, str | None]:
    """(the target in origin form, the authority of an absolute-form one): a server MUST
    accept the absolute form (RFC 9112 3.2.2) and route it as the origin form, with the
    authority as the host."""
    if target[:1] == "/":
        return target, None
    absolute = _ABSOLUTE.match(target)
    if absolute is None:  # "*" (OPTIONS) or a malformed target: routed as it came
        return target, None
    rest = target[absolute.end() :]
    authority = absolute.group(1).rpartition("@")[2]  # without userinfo
    return (rest if rest[:1] == "/" else "/" + rest), authority


# What a connection is doing, and so which deadline the sweep holds it to.
BODY, BUSY, IDLE = "body", "busy", "idle"
# File descriptors a worker keeps for other than its clients (the database, the gateway's
# link, logs, the loop): the connection cap stays this far below RLIMIT_NOFILE.
SPARE_FILES = 128


def connection_cap(configured: int) -> int:
    """WEB_MAX_CONNECTIONS, lowered to stay below the process's open-file limit (its soft
    limit raised to the hard one first, as any process may): past that limit every new
    connection would be closed at once, with no answer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY or configured + SPARE_FILES <= soft:
        return configured
    lowered = max(soft - SPARE_FILES, 1)
    log.warning(
        "web.connections_capped",
        extra={"configured": configured, "cap": lowered, "open_files_limit": soft},
    )
    return lowered


def queued(connection: web.RequestHandler) -> int:
    """Requests aiohttp has parsed that wait for their turn on this connection. aiohttp has
    no public name for them: its private deque `RequestHandler._messages` (3.14), read only
    here; `test_what_aiohttp_queues_is_where_we_read_it` in tests/test_web_server.py fails
    if aiohttp changes it."""
    return len(connection._messages)


class Gate(asyncio.Transport):
    """The transport as aiohttp sees it. aiohttp pauses and resumes reading for its own
    reasons (its queue of parsed requests, a body not yet read); the connection holds it
    paused for ours (a request being answered). Reading resumes when neither holds it."""

    __slots__ = ("ours", "theirs", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self.transport = transport
        self.ours = self.theirs = False

    def hold(self) -> None:
        if not self.ours:
            self.ours = True
            if not self.theirs:
                self._pause()

    def release(self) -> None:
        if self.ours:
            self.ours = False
            if not self.theirs:
                self._resume()

    def _pause(self) -> None:
        with contextlib.suppress(RuntimeError, AttributeError, NotImplementedError):
            self.transport.pause_reading()

    def _resume(self) -> None:
        with contextlib.suppress(RuntimeError, AttributeError, NotImplementedError):
            self.transport.resume_reading()

    def pause_reading(self) -> None:
        if not self.theirs:
            self.theirs = True
            if not self.ours:
                self._pause()

    def resume_reading(self) -> None:
        if self.theirs:
            self.theirs = False
            if not self.ours:
                self._resume()

    def is_reading(self) -> bool:
        return self.transport.is_reading()

    def write(self, data: Any) -> None:
        self.transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self.transport.writelines(list_of_data)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.transport.close()

    def abort(self) -> None:
        self.transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.transport.set_write_buffer_limits(high, low)

    def can_write_eof(self) -> bool:
        return self.transport.can_write_eof()

    def write_eof(self) -> None:
        self.transport.write_eof()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.transport.get_protocol()


class Connection(web.RequestHandler):
    """aiohttp's HTTP/1.1 connection (its public protocol class), known to the site: the
    sweep holds it to the body and flush deadlines, and a head aiohttp's parser refuses is
    answered with our headers and logged like any answer (`handle_error`)."""

    __slots__ = (
        "flush_since", "gate", "handling", "head_bytes", "held", "idle_since", "phase",
        "since", "site", "wire",
    )  # fmt: skip

    def __init__(self, manager: web.Server, site: Site, **options: Any) -> None:
        super().__init__(manager, **options)
        self.site = site
        self.wire: asyncio.Transport | None = None  # aiohttp forgets it when closing
        self.gate: Gate | None = None
        self.phase = IDLE
        self.since = self.idle_since = time.monotonic()
        self.flush_since: float | None = None
        self.handling = False  # a request of this connection is being answered
        self.held = bytearray()  # what came while one was (not given to aiohttp's parser)
        self.head_bytes = 0  # of the head being read, while waiting for one

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        wire: asyncio.Transport = transport  # type: ignore[assignment]
        self.gate = Gate(wire)
        super().connection_made(self.gate)
        self.wire = wire
        self.site.admit(self)

    # ------------------------------------------------------------ what is read, and when
    def waits(self) -> bool:
        """Whether what comes now must wait: a request is being answered (its body read
        already), or requests parsed already wait for their turn. So a connection holds at
        most one read from the socket ahead of the request being answered."""
        return bool(queued(self)) or (self.handling and self.phase != BODY)

    def idle(self) -> bool:
        """Waiting for a head (none begun, or one in progress): nothing being answered."""
        return not self.handling and not self.held and not queued(self)

    def data_received(self, data: bytes) -> None:
        if data and (self.held or self.waits()):
            self.held += data
            assert self.gate is not None
            self.gate.hold()
            return
        self.feed(data)

    def feed(self, data: bytes) -> None:
        """Give `data` to aiohttp's parser. While waiting for a head, no more than
        WEB_MAX_HEAD_BYTES before it ends: beyond that the head is refused (431) while it
        is read, not once it was whole."""
        if self.handling or not data:  # a body being read (or aiohttp parsing what it held)
            super().data_received(data)
            return
        room = self.site.limits.max_head_bytes - self.head_bytes
        piece = data[:room] if len(data) > room else data
        self.head_bytes += len(piece)
        super().data_received(piece)
        if queued(self):  # a head (or aiohttp's refusal of one) is whole: its turn
            self.head_bytes = 0
            if len(piece) < len(data):
                self.data_received(data[len(piece) :])
        elif self.head_bytes >= self.site.limits.max_head_bytes:
            self.site.refuse(self, 431, "Request Header Fields Too Large",
                             b"request head too large\n")  # fmt: skip

    def release(self) -> None:
        """What came while a request was answered, to the parser once it may be read."""
        if self.held and not self.waits():
            data, self.held = bytes(self.held), bytearray()
            assert self.gate is not None
            self.gate.release()
            self.feed(data)

    def begin(self) -> None:
        self.handling = True

    def end(self) -> None:
        """The request was answered: the next head may be read."""
        self.handling = False
        self.head_bytes = 0
        self.phase = IDLE
        self.idle_since = time.monotonic()
        self.release()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.site.connections.discard(self)
        super().connection_lost(exc)

    def resume_writing(self) -> None:
        """The socket took what was waiting (down to the low-water mark): progress."""
        super().resume_writing()
        self.flush_since = None

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.since = time.monotonic()
        if phase == BODY:  # its body may be read now
            self.release()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a head its parser refused, or to an exception that escaped
        `Site.handle` (a bug): with our headers, logged masked, and the connection closed."""
        if request.writer.output_size > 0:  # (as aiohttp's own): too late for an answer
            raise ConnectionError("the answer had begun")
        if isinstance(exc, LineTooLong) or (
            # aiohttp raises the plain class for this one, with this message: a test in
            # tests/test_web_server.py (the heads aiohttp's parser refuses) fails if it changes.
            type(exc) is BadHttpMessage and "Too many headers" in str(exc)
        ):
            status, text = 431, b"request head too large\n"
        elif status == 400:
            text = b"bad request\n"
        else:
            log.error("web.answer_failed", exc_info=exc,
                      extra={"error_type": type(exc).__name__})  # fmt: skip
            status, text = 500, b"internal error\n"
        response = web.Response(status=status, body=text, headers=[_TEXT, _SERVER])
        self.site.finish(response, request, time.perf_counter(), len(text), close=True)
        return response


# --------------------------------------------------------------------------- one worker
class Site:
    """The routes of one worker, with what they share: the thread pool, the connections."""

    def __init__(
        self,
        *,
        django: wsgi_bridge.WsgiApplication,
        resources: Sequence[Resource],
        limits: Limits,
        threads: int,
        multiprocess: bool = True,
    ) -> None:
        from pushsite import security

        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="web")
        self.threads = threads
        self.django = django
        self.multiprocess = multiprocess
        self.resources = tuple(resources)
        self.limits = limits
        self.stopping = False
        self.connections: set[Connection] = set()
        self.evicted = self.refused = 0  # at the connection cap, since the last log line
        self._security = security
        self._proxy_header = security.proxy_header_name()

    def server(self) -> web.Server:
        """aiohttp's protocol factory, making our `Connection`s with the limits."""
        site = self
        options = {**self.limits.parser_options(), "access_log": None}

        class Server(web.Server):
            def __call__(self) -> Connection:
                return Connection(self, site, loop=asyncio.get_running_loop(), **options)

        return Server(self.handle)

    async def in_thread(self, work: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, work)

    # ---------------------------------------------------------------- one request
    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """aiohttp's handler: answer one request whose head was read; never raises."""
        started = time.perf_counter()
        connection: Connection = request.protocol  # type: ignore[assignment]
        connection.begin()
        try:
            response = await self._handle(request, connection, started)
            if response.keep_alive:
                await self._drop_body(request, connection)
            return response
        finally:
            connection.end()

    async def _handle(
        self, request: web.BaseRequest, connection: Connection, started: float
    ) -> web.StreamResponse:
        close = False
        try:
            answer = self.limit_refusal(request)
            if answer is not None:
                close = True
            else:
                answer, close = await self._answer(request, connection)
        except web.RequestPayloadError:  # a malformed chunked body
            answer, close = (400, [_TEXT], b"bad request\n"), True
        except Exception as error:  # never leave the client waiting: answer 500
            transport = request.transport
            if isinstance(error, (ConnectionError, asyncio.IncompleteReadError)) and (
                transport is None or transport.is_closing()
            ):  # the client went away (or the sweep closed it): no one to answer
                return web.Response(status=499)  # (aiohttp finds the connection closed)
            log.exception("web.answer_failed", extra={"error_type": type(error).__name__})
            answer, close = (500, [_TEXT], b"internal error\n"), True
        status, headers, body = answer
        if not _sendable(headers):
            log.error("web.answer_unsendable", extra={"status": status})
            status, headers, body, close = 500, [_TEXT], b"internal error\n", True
        return await self.send(request, status, headers, body, started, close=close)

    async def _drop_body(self, request: web.BaseRequest, connection: Connection) -> None:
        """A body left unread by a refusal from the head (413, 411): read and dropped within
        WEB_MAX_BODY_BYTES and WEB_BODY_SECONDS (the sweep), so the connection stays usable;
        beyond them it is closed."""
        content = request.content
        if not request.body_exists or content.is_eof():
            return
        connection.enter(BODY)
        dropped = 0
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError,
                                 web.RequestPayloadError):  # fmt: skip
            while not content.is_eof() and dropped <= self.limits.max_body_bytes:
                dropped += len(await content.readany())
        if not content.is_eof():
            connection.force_close()

    def limit_refusal(self, request: web.BaseRequest) -> Answer | None:
        """The configured limits of a head aiohttp's parser took (within its own)."""
        limits = self.limits
        line = len(request.method) + len(request.raw_path) + 10  # two spaces, "HTTP/1.1"
        if line > limits.max_request_line:
            return 414, [_TEXT], b"request line too long\n"
        raw = request.raw_headers
        if len(raw) > limits.max_headers:
            return 431, [_TEXT], b"too many header fields\n"
        # Each line with its CRLF (a field's ": " too), and the empty line that ends the head.
        head = line + 4 + sum(len(name) + len(value) + 4 for name, value in raw)
        if head > limits.max_head_bytes:
            return 431, [_TEXT], b"request head too large\n"
        return None

    async def _answer(
        self, request: web.BaseRequest, connection: Connection
    ) -> tuple[Answer, bool]:
        """(the answer, whether to close the connection after it)."""
        method = request.method
        target, authority = origin_form(request.raw_path)
        path = unquote(target.partition("?")[0])
        route = next((r for r in self.resources if r.paths.fullmatch(path)), None)
        length = request.content_length
        if length is not None and length > self.limits.max_body_bytes:
            return (400, [_TEXT], b"body too large\n"), True
        if route is not None:
            early = route.refusal(method, path, request.headers.get)
            if early is not None:
                return early, False  # aiohttp reads and drops the body (lingering_time)
        body = await self._body(request, connection)
        if body is None:
            return (400, [_TEXT], b"body too large\n"), True
        if route is not None:
            body = body[: route.max_body_bytes]
            answer = await route.answer(method, path, request.headers.get, body, self.in_thread)
            return answer, False
        version = request.version
        environ = wsgi_bridge.environ(
            method=method,
            target=target,
            version=f"HTTP/{version.major}.{version.minor}",
            headers=request.raw_headers,
            body=body,
            remote=request.remote or "",
            server=self._server_address(request),
            multiprocess=self.multiprocess,
            authority=authority,
        )
        status, _, headers, content = await self.in_thread(
            lambda: wsgi_bridge.run(self.django, environ)
        )
        return (status, headers, content), False

    async def _body(self, request: web.BaseRequest, connection: Connection) -> bytes | None:
        """The body, read whole within WEB_MAX_BODY_BYTES (None beyond it); while it is not
        all here the sweep holds the connection to WEB_BODY_SECONDS."""
        if not request.body_exists:
            return b""
        content = request.content
        length = request.content_length
        if length is not None and content.is_eof():  # all here with the head: no wait
            return await content.readexactly(length)
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        connection.enter(BODY)
        try:
            if length is not None:
                return await content.readexactly(length)
            chunks = bytearray()
            while not content.is_eof():
                chunks += await content.readany()
                if len(chunks) > self.limits.max_body_bytes:
                    return None
            return bytes(chunks)
        finally:
            connection.enter(BUSY)

    @staticmethod
    def _server_address(request: web.BaseRequest) -> tuple[str, int]:
        transport = request.transport
        address = transport.get_extra_info("sockname") if transport is not None else None
        if isinstance(address, tuple) and len(address) >= 2:
            return str(address[0]), int(address[1])
        return "localhost", 0

    # ---------------------------------------------------------------- every answer
    async def send(
        self,
        request: web.BaseRequest,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        started: float,
        *,
        close: bool,
    ) -> web.StreamResponse:
        """Write one answer with the security headers and a Server header of ours, close
        the connection after it if asked (or stopping), log and count it."""
        response = web.Response(status=status, body=body, headers=[_SERVER, *headers])
        if self.finish(response, request, started, len(body), close=close):
            with contextlib.suppress(ConnectionError):
                await response.prepare(request)
                await response.write_eof()
        return response

    def finish(
        self,
        response: web.StreamResponse,
        request: web.BaseRequest,
        started: float,
        sent: int,
        *,
        close: bool,
    ) -> bool:
        """Our part of every answer: the security headers, `Connection: close` when the
        connection ends after it, the access line, the count. False: the client is gone."""
        fields = response.headers
        secure = False
        if self._proxy_header is not None:
            secure = self._security.is_secure(request.headers.get(self._proxy_header))
        for name, value in self._security.security_headers(secure):
            fields[name] = value
        if close or self.stopping:
            response.force_close()
        from relay import metrics

        method = request.method
        target = request.raw_path
        elapsed = time.perf_counter() - started
        path = unquote(origin_form(target)[0].partition("?")[0])
        metrics.count_request(path, method, response.status, elapsed)
        if access_log.isEnabledFor(logging.INFO):
            version = request.version
            access_log.info(
                '%s "%s %s HTTP/%d.%d" %d %d',
                request.remote,
                method,
                target,
                version.major,
                version.minor,
                response.status,
                0 if method == "HEAD" else sent,
                extra={"status": response.status, "ms": round(elapsed * 1000, 2)},
            )
        transport = request.transport
        return transport is not None and not transport.is_closing()

    # ---------------------------------------------------------------- the connection cap
    def admit(self, connection: Connection) -> None:
        """A new connection, within WEB_MAX_CONNECTIONS: at the cap, the connection that has
        waited longest for a head is closed to make room (idle ones cannot keep a worker
        from its clients); when every one is being answered, the new one is refused (503
        with Connection: close)."""
        self.connections.add(connection)
        if len(self.connections) <= self.limits.max_connections:
            return
        waiting = [other for other in self.connections if other is not connection and other.idle()]
        if waiting:
            oldest = min(waiting, key=lambda other: other.idle_since)
            self.evicted += 1
            if oldest.wire is not None:
                oldest.wire.close()
            self.connections.discard(oldest)
            return
        self.refused += 1
        self.refuse(connection, 503, "Service Unavailable", b"too many connections\n")

    def refuse(self, connection: Connection, status: int, reason: str, text: bytes) -> None:
        """An answer written before any request of this connection was parsed (a head too
        large while it is read, a connection over the cap): our headers, an access line,
        the count, then the connection closed."""
        wire = connection.wire
        self.connections.discard(connection)
        if wire is None or wire.is_closing():
            return
        fields = [
            _SERVER, _TEXT, ("Content-Length", str(len(text))), ("Connection", "close"),
            ("Date", formatdate(usegmt=True)), *self._security.security_headers(False),
        ]  # fmt: skip
        head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in fields)
        wire.write(head.encode("latin-1") + b"\r\n" + text)
        connection.force_close()  # (closes the transport: what was written is sent first)
        wire.close()
        from relay import metrics

        metrics.count_request("", "other", status, 0.0)
        peer = wire.get_extra_info("peername")
        access_log.info('%s "-" %d %d', peer[0] if peer else "-", status, len(text),
                        extra={"status": status, "ms": 0.0})  # fmt: skip

    # ---------------------------------------------------------------- deadlines and stop
    async def sweep(self) -> None:
        """Twice a second: a body past WEB_BODY_SECONDS closes its connection; an answer the
        socket has not taken WEB_FLUSH_SECONDS after it began to wait closes it hard (RST).
        One pass over the connections instead of a timer per request."""
        limits = self.limits
        logged = 0.0
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            now = time.monotonic()
            if (self.evicted or self.refused) and now - logged > 10:  # one line per 10 s
                log.warning(
                    "web.connection_cap",
                    extra={"cap": limits.max_connections, "idle_closed": self.evicted,
                           "refused": self.refused},
                )  # fmt: skip
                self.evicted = self.refused = 0
                logged = now
            for connection in list(self.connections):
                wire = connection.wire
                if wire is None:
                    continue
                if wire.get_write_buffer_size():
                    if connection.flush_since is None:
                        connection.flush_since = now
                    elif now - connection.flush_since > limits.flush_seconds:
                        log.warning("web.flush_timeout", extra={"seconds": limits.flush_seconds})
                        hard_close(wire)
                        continue
                else:
                    connection.flush_since = None
                if connection.phase == BODY and now - connection.since > limits.body_seconds:
                    connection.enter(IDLE)
                    wire.close()

    async def stop(self, listeners: Sequence[asyncio.AbstractServer], server: web.Server) -> None:
        """Stop accepting; close idle connections at once and the others once their answer
        is out (with `Connection: close`); wait for them, at most WEB_GRACEFUL_SECONDS."""
        self.stopping = True
        for listener in listeners:
            listener.close()
        server.pre_shutdown()
        await server.shutdown(self.limits.graceful_seconds)
        for connection in list(self.connections):  # answers not taken within the time
            if connection.wire is not None and connection.wire.get_write_buffer_size():
                hard_close(connection.wire)
        await self._close_database_connections()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _close_database_connections(self) -> None:
        """Each thread of the pool closes its own database connections (Django keeps them per
        thread, persistent): a stopping worker leaves none open for the database to time out.
        The barrier gives each thread one of these; a thread still busy is left to exit."""
        from django.db import connections

        barrier = threading.Barrier(self.threads)

        def close() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(self.limits.graceful_seconds)
            connections.close_all()

        loop = asyncio.get_running_loop()
        closing = [loop.run_in_executor(self.executor, close) for _ in range(self.threads)]
        await asyncio.wait(closing, timeout=self.limits.graceful_seconds + 1.0)


def hard_close(transport: asyncio.Transport) -> None:
    """Close now, dropping what was not sent, and reset the connection (RST): nothing waits
    for a client that stopped reading."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def bind_sockets(port: int, host: str, backlog: int = 1024) -> list[socket.socket]:
    """The listening sockets for `host` (every address it resolves to), before the fork."""
    sockets: list[socket.socket] = []
    for family, kind, proto, _, address in socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if port == 0 and sockets:  # the same free port on every address
            address = (address[0], sockets[0].getsockname()[1], *address[2:])
        sock.bind(address)
        sock.setblocking(False)
        sock.listen(backlog)
        sockets.append(sock)
    return sockets


async def serve(
    sockets: list[socket.socket], site_factory: Callable[[], Site], stop: asyncio.Event
) -> None:
    """Serve on `sockets` until `stop` is set, then stop gracefully."""
    site = site_factory()
    server = site.server()
    loop = asyncio.get_running_loop()
    listeners = [await loop.create_server(server, sock=sock) for sock in sockets]
    sweep = asyncio.ensure_future(site.sweep())
    try:
        await stop.wait()
        await site.stop(listeners, server)
    finally:
        sweep.cancel()
        for sock in sockets:  # uvloop serves a duplicate: this one must go too
            sock.close()


def _site() -> Site:
    from pushsite.wsgi import application
    from relay import conf, features

    current = conf.current()
    site = Site(
        django=application,
        resources=features.web_resources(),
        limits=Limits.from_conf(),
        threads=current.web_threads,
        multiprocess=current.web_workers > 1,
    )
    gc.collect()
    gc.freeze()  # the application lives as long as the worker: out of the full collections
    return site


def _worker(sockets: list[socket.socket]) -> int:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for number in _STOP_SIGNALS:
            loop.add_signal_handler(number, stop.set)
        log.info("web.worker_started", extra={"pid": os.getpid()})
        await serve(sockets, _site, stop)

    uvloop.run(run())  # asyncio's loop in C
    log.info("web.worker_stopped", extra={"pid": os.getpid()})
    return 0


# --------------------------------------------------------------------------- the supervisor
def _metrics_directory(directory: str) -> tuple[str, bool]:
    """`directory` (WEB_METRICS_DIR) emptied of old files, or a fresh temporary directory
    (True: ours to remove). Set for the workers before anything imports prometheus_client."""
    made = not directory
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        for stale in Path(directory).glob("*.db"):
            stale.unlink()
    else:
        directory = tempfile.mkdtemp(prefix="relay-web-metrics-")
    # Only here, never in the shared environment: the gateway and the worker must not write
    # their values into the web's files (nor have them removed at the web's next start).
    os.environ[MULTIPROC_ENV] = directory
    return directory, made


def _check_static(root: Path) -> None:
    """One line when `collectstatic` has not run (the admin then has no styles or scripts),
    instead of WhiteNoise's warning from every worker it forks."""
    if root.is_dir():
        return
    log.warning(
        "web.static_missing",
        extra={"static_root": str(root), "fix": "manage.py collectstatic --noinput"},
    )
    # Inherited by the workers: WhiteNoise says so again in each as it starts.
    warnings.filterwarnings(
        "ignore", message=re.escape(f"No directory at: {root}"), category=UserWarning
    )


class Supervisor:
    """Forks the workers, starts another when one dies, stops them on SIGTERM or SIGINT."""

    def __init__(self, sockets: list[socket.socket], workers: int, graceful: float) -> None:
        self.sockets = sockets
        self.count = workers
        self.graceful = graceful
        self.workers: dict[int, float] = {}  # pid: when it started

    def run(self) -> int:
        watched = {*_STOP_SIGNALS, signal.SIGCHLD}
        # Blocked and taken by sigtimedwait below. Handlers too (never run while blocked), so
        # the process says it handles them (/proc's SigCgt; the kernel unblocks the waited-for
        # signals during the wait, so SigBlk does not show them then).
        for number in watched:
            signal.signal(number, lambda *_: None)
        signal.pthread_sigmask(signal.SIG_BLOCK, watched)
        for _ in range(self.count):
            self._spawn()
        while True:
            info = signal.sigtimedwait(watched, 1.0)
            if info is None or info.si_signo == signal.SIGCHLD:
                self._reap(restart=True)
                continue
            log.info("web.stopping", extra={"signal": signal.Signals(info.si_signo).name})
            return self._stop()

    def _spawn(self) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                for number in (*_STOP_SIGNALS, signal.SIGCHLD):
                    signal.signal(number, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, set())
                code = _worker(self.sockets)
            except BaseException:
                log.exception("web.worker_failed")
            finally:
                logging.shutdown()
                os._exit(code)
        self.workers[pid] = time.monotonic()

    def _reap(self, *, restart: bool) -> None:
        from prometheus_client import multiprocess

        while self.workers:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            started = self.workers.pop(pid, None)
            if started is None:
                continue
            # Its live gauges (in-flight sends) stop counting; its counters stay.
            multiprocess.mark_process_dead(pid)
            if restart:
                log.error("web.worker_died", extra={"pid": pid, "status": status})
                if time.monotonic() - started < 1.0:
                    time.sleep(1.0)  # one that dies at once is not restarted in a tight loop
                self._spawn()

    def _stop(self) -> int:
        for pid in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.graceful + 5.0
        while self.workers and time.monotonic() < deadline:
            signal.sigtimedwait({signal.SIGCHLD}, 0.5)
            self._reap(restart=False)
        for pid in list(self.workers):
            log.error("web.worker_killed", extra={"pid": pid})
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while self.workers:
            os.waitpid(next(iter(self.workers)), 0)
            self._reap(restart=False)
        return 0


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
    # Settings and logging only (neither imports prometheus_client): the applications load
    # in each worker (django.setup() in pushsite/wsgi.py), so that only workers keep metric
    # values (files in the directory).
    from django.conf import settings
    from django.utils.log import configure_logging

    configure_logging(settings.LOGGING_CONFIG, settings.LOGGING)
    from relay import conf

    current = conf.current()
    directory, made = _metrics_directory(current.web_metrics_dir)
    _check_static(Path(settings.STATIC_ROOT))
    host, _, port = current.web_bind.rpartition(":")  # its form: manage.py check (relay.E130)
    if not host or not port.isdigit():
        raise SystemExit("WEB_BIND must be host:port (manage.py check says more)")
    sockets = bind_sockets(int(port), host.strip("[]"), backlog=1024)
    log.info(
        "web.started",
        extra={"bind": current.web_bind, "workers": current.web_workers,
               "threads": current.web_threads},
    )  # fmt: skip
    try:
        return Supervisor(sockets, current.web_workers, current.web_graceful_seconds).run()
    finally:
        for sock in sockets:
            sock.close()
        if made:
            shutil.rmtree(directory, ignore_errors=True)
        log.info("web.stopped")


if __name__ == "__main__":
    sys.exit(main())
