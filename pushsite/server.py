"""The web process: `python -m pushsite.server`.

Tornado's HTTP/1.1 server (its public interface only), in WEB_WORKERS processes forked from
this one, each with one event loop and a pool of WEB_THREADS threads:

- `/push/…` and `/_matrix/push/v1/notify` go to the UnifiedPush resource
  (relay/unifiedpush/http.py) on the event loop: a POST waiting for the phone holds no thread;
- everything else goes to Django (pushsite/wsgi.py) through `tornado.wsgi.WSGIContainer`, on
  the thread pool.

Every answer, whichever route made it, passes one place (`_Answer`): the security headers
Django's settings call for (pushsite/security.py), the access log line (masked), the request
counted for /metrics, and a deadline on flushing it. Why Tornado, and what each limit does:
docs/web.md. What Tornado leaves to us is here and small: the request line's length and the
number of header fields (it bounds the head's bytes), the flush deadline and its hard close,
and a graceful stop (answer what is held, then close).

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
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote

import uvloop
from tornado.http1connection import HTTP1ConnectionParameters, HTTP1ServerConnection
from tornado.httputil import (
    HTTPConnection,
    HTTPHeaders,
    HTTPMessageDelegate,
    HTTPServerConnectionDelegate,
    HTTPServerRequest,
    ResponseStartLine,
    format_timestamp,
    responses,
)
from tornado.netutil import bind_sockets
from tornado.tcpserver import TCPServer
from tornado.wsgi import WSGIContainer

log = logging.getLogger("pushsite.server")
access_log = logging.getLogger("pushsite.access")

Answer = tuple[int, list[tuple[str, str]], bytes]
Header = Callable[[str], str | None]
InThread = Callable[[Callable[[], Any]], Awaitable[Any]]
# prometheus_client's own variable: set here for the workers, never read from the operator's
# environment (.env.example: WEB_METRICS_DIR).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CHUNK_BYTES = 64 * 1024
SWEEP_SECONDS = 0.5
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        )


class Resource(Protocol):
    """A route served on the event loop (relay.unifiedpush.http.PushResource)."""

    max_body_bytes: int

    def refusal(self, method: str, path: str, header: Header) -> Answer | None: ...

    async def answer(
        self, method: str, path: str, header: Header, body: bytes, in_thread: InThread
    ) -> Answer: ...


# --------------------------------------------------------------------------- one request
def _limit_refusal(limits: Limits, start_line: Any, headers: Any) -> Answer | None:
    """Tornado bounds the head's bytes (max_header_size); the request line and the number of
    fields are bounded here."""
    line = len(start_line.method) + len(start_line.path) + len(start_line.version) + 2
    if line > limits.max_request_line:
        return 414, [("Content-Type", "text/plain")], b"request line too long\n"
    if sum(1 for _ in headers.get_all()) > limits.max_headers:
        return 431, [("Content-Type", "text/plain")], b"too many header fields\n"
    return None


class _Date:
    """The Date header, formatted once a second."""

    second = -1
    value = ""

    @classmethod
    def now(cls) -> str:
        second = int(time.time())
        if second != cls.second:
            cls.value, cls.second = format_timestamp(second), second
        return cls.value


class _Exchange(HTTPMessageDelegate):
    """One request on one connection, from its head to its answer flushed."""

    def __init__(self, site: Site, peer: _Peer, connection: Any) -> None:
        self.site = site
        self.peer = peer
        self.connection = connection  # tornado's HTTP1Connection
        self.started = 0.0
        self.start_line: Any = None
        self.headers: Any = None
        self.path = ""
        self.route: Resource | None = None
        self.early: Answer | None = None
        self.close = False
        self.room = 0
        self.body = bytearray()
        self.answer = _Answer(self)

    def headers_received(self, start_line: Any, headers: Any) -> None:
        self.started = time.perf_counter()
        self.peer.enter(BODY)
        self.start_line, self.headers = start_line, headers
        self.path = unquote(start_line.path.partition("?")[0])
        self.early = _limit_refusal(self.site.limits, start_line, headers)
        if self.early is not None:
            self.close = True
            return
        self.room = self.site.limits.max_body_bytes
        resource = self.site.resource
        if resource is not None and self.site.resource_paths.fullmatch(self.path):
            self.route = resource
            self.room = resource.max_body_bytes
            self.early = resource.refusal(start_line.method, self.path, headers.get)
        if self.early is not None:
            self.room = 0  # read and dropped: the connection stays usable

    def data_received(self, chunk: bytes) -> None:
        if len(self.body) < self.room:
            self.body += chunk[: self.room - len(self.body)]

    def finish(self) -> None:
        self.peer.enter(BUSY)
        if self.early is not None:
            self.answer.send(*self.early)
            return
        self.site.spawn(self._serve())

    async def _serve(self) -> None:
        try:
            if self.route is not None:
                status, headers, body = await self.route.answer(
                    self.start_line.method,
                    self.path,
                    self.headers.get,
                    bytes(self.body),
                    self.site.in_thread,
                )
                self.answer.send(status, headers, body)
            else:
                request = HTTPServerRequest(
                    connection=self.answer, start_line=self.start_line, headers=self.headers
                )
                request.body = bytes(self.body)
                await self.site.django.handle_request(request)
        except Exception as error:  # never leave the client waiting: answer 500, or end it
            log.exception("web.answer_failed", extra={"error_type": type(error).__name__})
            self.answer.fail()

    def on_connection_close(self) -> None:
        """The client went away before its request was read whole."""
        self.peer.enter(IDLE)


class _Answer(HTTPConnection):
    """The connection as the routes see it (tornado's HTTPConnection interface): every answer
    gets the security headers and a Date, is logged and counted, and must be flushed within
    WEB_FLUSH_SECONDS, or the connection is closed hard (a client that stopped reading holds
    nothing for ever)."""

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange
        self.inner = exchange.connection
        self.context = self.inner.context  # HTTPServerRequest reads the peer's address here
        self.status = 0
        self.sent = 0
        self.head_written = False
        self.flushed: Any = None  # the Future of the last write

    def send(self, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> None:
        fields = HTTPHeaders()
        for name, value in headers:
            fields.add(name, value)
        fields["Content-Length"] = str(len(body))
        start_line = ResponseStartLine("HTTP/1.1", status, responses.get(status, "Unknown"))
        self.write_headers(start_line, fields, body)
        self.finish()

    def write_headers(self, start_line: Any, headers: Any, chunk: bytes | None = None) -> Any:
        exchange = self.exchange
        site = exchange.site
        self.status = start_line.code
        for name, value in site.security_headers(exchange.headers):
            headers[name] = value
        headers["Date"] = _Date.now()
        if "Server" in headers:
            del headers["Server"]
        if exchange.close or site.stopping:
            exchange.close = True
            headers["Connection"] = "close"
        if exchange.start_line.method == "HEAD":
            chunk = None
        self.flushed = self.inner.write_headers(start_line, headers, chunk)
        self.head_written = True  # only once written: a header it refused leaves room for a 500
        self.sent += len(chunk or b"")
        return self.flushed

    def write(self, chunk: bytes) -> Any:
        if self.exchange.start_line.method == "HEAD":
            chunk = b""
        self.sent += len(chunk)
        self.flushed = self.inner.write(chunk)
        return self.flushed

    def finish(self) -> None:
        self.inner.finish()
        self.exchange.site.answered(self.exchange)

    def fail(self) -> None:
        """After an exception: the 500 answer if nothing was written yet, else the end."""
        if not self.head_written:
            self.exchange.close = True
            with contextlib.suppress(Exception):
                self.send(500, [("Content-Type", "text/plain")], b"internal error\n")
                return
        self.abort()

    def abort(self) -> None:
        """Close now, dropping what was not sent (RST)."""
        _hard_close(self.inner)
        self.inner.close()
        self.exchange.peer.enter(IDLE)


def _hard_close(connection: Any) -> None:
    """Have the next close drop what was not sent and reset the connection (RST): nothing
    waits for a client that stopped reading."""
    stream = connection.stream
    if stream is not None and not stream.closed():
        with contextlib.suppress(OSError):
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# What a connection is doing, and so which deadline it has (WEB_*_SECONDS), if any.
HEAD, BODY, BUSY, FLUSH, IDLE = "head", "body", "busy", "flush", "idle"


class _Peer:
    """One client connection: waiting for a head, reading a body, busy answering, flushing
    the answer. The site's sweep closes it once it is past the deadline of what it does."""

    __slots__ = ("connection", "phase", "server_connection", "since")

    def __init__(self, server_connection: Any) -> None:
        self.server_connection = server_connection
        self.connection: Any = None  # the current request's HTTP1Connection
        self.phase = IDLE
        self.since = 0.0

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.since = time.monotonic()

    @property
    def busy(self) -> bool:
        return self.phase in (BODY, BUSY, FLUSH)


# --------------------------------------------------------------------------- one worker
class Site(HTTPServerConnectionDelegate):
    """The routes of one worker, with what they share: the thread pool, the connections."""

    def __init__(
        self,
        *,
        django: Callable[..., Any],
        resource: Resource | None,
        resource_paths: Any,
        limits: Limits,
        threads: int,
    ) -> None:
        from pushsite import security

        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="web")
        self.django = WSGIContainer(_trimmed_headers(django), executor=self.executor)
        self.resource = resource
        self.resource_paths = resource_paths
        self.limits = limits
        self.stopping = False
        self.peers: dict[Any, _Peer] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._security = security
        self._proxy_header = security.proxy_header_name()
        self._idle = asyncio.Event()

    # tornado's HTTPServerConnectionDelegate
    def start_request(self, server_connection: Any, request_connection: Any) -> Any:
        peer = self.peers.get(server_connection)
        if peer is None:
            peer = self.peers[server_connection] = _Peer(server_connection)
            self._idle.clear()
        peer.connection = request_connection
        peer.enter(HEAD)
        if self.stopping:
            self.spawn(server_connection.close())
        return _Exchange(self, peer, request_connection)

    def on_close(self, server_connection: Any) -> None:
        self.peers.pop(server_connection, None)
        if not self.peers:
            self._idle.set()

    async def in_thread(self, work: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, work)

    def spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def security_headers(self, request_headers: Any) -> tuple[tuple[str, str], ...]:
        secure = False
        if self._proxy_header is not None:
            secure = self._security.is_secure(request_headers.get(self._proxy_header))
        return self._security.security_headers(secure)

    def answered(self, exchange: _Exchange) -> None:
        """The answer is written (maybe not yet flushed): logged, counted, and watched."""
        from relay import metrics

        answer = exchange.answer
        elapsed = time.perf_counter() - exchange.started
        start_line = exchange.start_line
        metrics.count_request(exchange.path, start_line.method, answer.status, elapsed)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(
                '%s "%s %s %s" %d %d',
                answer.context.remote_ip,
                start_line.method,
                start_line.path,
                start_line.version,
                answer.status,
                answer.sent,
                extra={"status": answer.status, "ms": round(elapsed * 1000, 2)},
            )
        flushed = answer.flushed
        if flushed is None or flushed.done():
            self._flushed(exchange)
            return
        exchange.peer.enter(FLUSH)  # the sweep ends it if the socket takes too long
        flushed.add_done_callback(lambda _: self._flushed(exchange))

    def _flushed(self, exchange: _Exchange) -> None:
        if exchange.peer.phase != HEAD:  # (the next request may have begun already)
            exchange.peer.enter(IDLE)
        if exchange.close:
            exchange.connection.close()

    async def sweep(self) -> None:
        """Once a second: connections past the deadline of what they do are closed, those
        that do not take their answer hard (RST). One pass over the connections instead of
        a timer per request."""
        limits = self.limits
        deadlines = {
            HEAD: limits.head_seconds,
            BODY: limits.body_seconds,
            FLUSH: limits.flush_seconds,
        }
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            now = time.monotonic()
            for peer in list(self.peers.values()):
                limit = deadlines.get(peer.phase)
                if limit is None or now - peer.since <= limit or peer.connection is None:
                    continue
                if peer.phase == FLUSH:
                    log.warning("web.flush_timeout", extra={"seconds": limits.flush_seconds})
                    _hard_close(peer.connection)
                peer.connection.close()
                peer.enter(IDLE)

    async def stop(self, server: Any) -> None:
        """Stop accepting; close idle connections at once and the others once their answer
        is out; wait for them, at most WEB_GRACEFUL_SECONDS."""
        self.stopping = True
        server.stop()
        for peer in list(self.peers.values()):
            if not peer.busy:
                self.spawn(peer.server_connection.close())
        if self.peers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), self.limits.graceful_seconds)
        for peer in list(self.peers.values()):
            self.spawn(peer.server_connection.close())
        self.executor.shutdown(wait=False, cancel_futures=True)


def _trimmed_headers(application: Callable[..., Any]) -> Callable[..., Any]:
    """The WSGI application with its header values trimmed: Django writes each Set-Cookie
    value with a leading space (`cookie.output(header="")`), which the wire allows around a
    value but Tornado's HTTPHeaders refuses as part of one (every answer setting a cookie
    would fail)."""

    def trimmed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        def start(status: str, headers: list[tuple[str, str]], *exc_info: Any) -> Any:
            return start_response(
                status, [(name, value.strip()) for name, value in headers], *exc_info
            )

        return application(environ, start)

    return trimmed


class _Context:
    """What tornado's HTTPServerRequest reads of a connection (`request.remote_ip`)."""

    __slots__ = ("address", "protocol", "remote_ip")

    def __init__(self, address: Any) -> None:
        self.address = address
        self.remote_ip = address[0] if isinstance(address, tuple) and address else "0.0.0.0"
        self.protocol = "http"

    def __str__(self) -> str:
        return self.remote_ip


class WebServer(TCPServer):
    """Tornado's HTTP/1.1 connections (HTTP1ServerConnection) for the site's requests, with
    the limits as Tornado names them. Its deadlines are the site's sweep rather than a timer
    per request: one pass a second costs less than a timer set and cancelled per request."""

    def __init__(self, site: Site) -> None:
        limits = site.limits
        super().__init__(
            # What it may read ahead: one chunk beyond the head, however fast a client
            # pipelines.
            max_buffer_size=limits.max_head_bytes + 2 * CHUNK_BYTES,
            read_chunk_size=CHUNK_BYTES,
        )
        self.site = site
        self.params = HTTP1ConnectionParameters(
            chunk_size=CHUNK_BYTES,
            max_header_size=limits.max_head_bytes,
            max_body_size=limits.max_body_bytes,
        )

    def handle_stream(self, stream: Any, address: Any) -> None:
        HTTP1ServerConnection(stream, self.params, _Context(address)).start_serving(self.site)


async def serve(
    sockets: list[socket.socket], site_factory: Callable[[], Site], stop: asyncio.Event
) -> None:
    """Serve on `sockets` until `stop` is set, then stop gracefully."""
    site = site_factory()
    server = WebServer(site)
    server.add_sockets(sockets)
    sweep = asyncio.ensure_future(site.sweep())
    await stop.wait()
    await site.stop(server)
    sweep.cancel()


def _site() -> Site:
    from pushsite.wsgi import application
    from relay import conf
    from relay.unifiedpush import http as unifiedpush_http

    site = Site(
        django=application,
        resource=unifiedpush_http.PushResource(),
        resource_paths=unifiedpush_http.PATHS,
        limits=Limits.from_conf(),
        threads=conf.current().web_threads,
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

    uvloop.run(run())  # asyncio's loop in C: less CPU per request than asyncio's own
    log.info("web.worker_stopped", extra={"pid": os.getpid()})
    return 0


# --------------------------------------------------------------------------- the supervisor
def _metrics_directory() -> tuple[str, bool]:
    """WEB_METRICS_DIR emptied of old files, or a fresh temporary directory (True: ours to
    remove). Set for the workers before anything imports prometheus_client."""
    directory = os.environ.get("WEB_METRICS_DIR", "")
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


class Supervisor:
    """Forks the workers, starts another when one dies, stops them on SIGTERM or SIGINT."""

    def __init__(self, sockets: list[socket.socket], workers: int, graceful: float) -> None:
        self.sockets = sockets
        self.count = workers
        self.graceful = graceful
        self.workers: dict[int, float] = {}  # pid: when it started

    def run(self) -> int:
        watched = {*_STOP_SIGNALS, signal.SIGCHLD}
        signal.signal(signal.SIGCHLD, lambda *_: None)  # delivered to sigwaitinfo below
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
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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
    directory, made = _metrics_directory()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
    # Settings and logging only: the applications load in each worker (django.setup() in
    # pushsite/wsgi.py), so that only workers keep metric values (files in the directory).
    from django.conf import settings
    from django.utils.log import configure_logging

    configure_logging(settings.LOGGING_CONFIG, settings.LOGGING)
    from relay import conf

    current = conf.current()
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
