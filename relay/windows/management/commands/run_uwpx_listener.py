"""Serve unmodified UWPX clients: NUL-framed JSON messages over TLS on TCP port 1997.

The shipped UWPX client cannot be pointed at an HTTP URL: it opens a TLS connection, sends one
JSON message followed by a NUL byte and reads the answer (also NUL-terminated). This listener
speaks exactly that and hands every message to the same code as the HTTP API
(`relay.windows.api.protocol.handle_frame`: rate limits, validation, services).

Settings (environment): UWPX_TLS_CERT_FILE and UWPX_TLS_KEY_FILE (PEM), UWPX_LISTEN_APP (the
app's public key), UWPX_LISTEN_ADDRESS (default 127.0.0.1), UWPX_LISTEN_PORT (default 1997).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections

from relay import conf
from relay.windows.api import protocol

log = logging.getLogger("relay.uwpx_listener")

TLS_HANDSHAKE_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    address: str
    port: int
    app_key: str
    cert_file: str
    key_file: str
    idle_seconds: float
    max_connections: int
    threads: int


def tls_context(*, cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context: TLS 1.2 or newer (the UWPX client asks for 1.2), no client certs."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def _answer(app_key: str, frame: bytes, client_address: str) -> dict[str, Any]:
    """Runs in a worker thread: the services use the (blocking) Django ORM."""
    close_old_connections()
    try:
        return protocol.handle_frame(app_key=app_key, frame=frame, client_address=client_address)
    finally:
        close_old_connections()


class UwpxListener:
    """The asyncio server: one task per connection, blocking work on a small thread pool."""

    def __init__(self, config: ListenerConfig, context: ssl.SSLContext) -> None:
        self.config = config
        self.context = context
        self.max_frame = conf.current().uwpx_max_body_bytes
        self._executor = ThreadPoolExecutor(config.threads, thread_name_prefix="uwpx")
        self._connections = 0
        self._stop = asyncio.Event()

    async def run(self) -> None:
        server = await asyncio.start_server(
            self._serve,
            self.config.address,
            self.config.port,
            ssl=self.context,
            ssl_handshake_timeout=TLS_HANDSHAKE_SECONDS,
            limit=self.max_frame + 1,
            reuse_address=True,
        )
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        ports = sorted({sock.getsockname()[1] for sock in server.sockets})
        log.info(
            "uwpx_listener.listening",
            extra={"address": self.config.address, "ports": ports},
        )
        async with server:
            await self._stop.wait()
            server.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        log.info("uwpx_listener.stopped")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._connections >= self.config.max_connections:
            log.warning("uwpx_listener.too_many_connections")
            writer.close()
            return
        self._connections += 1
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else ""
        try:
            await self._conversation(reader, writer, address)
        except (ConnectionError, ssl.SSLError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away or stalled: nothing to answer
        finally:
            self._connections -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 5)

    async def _conversation(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str
    ) -> None:
        """Answer each NUL-terminated message until the client closes or idles out."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                frame = await asyncio.wait_for(
                    reader.readuntil(b"\0"), timeout=self.config.idle_seconds
                )
            except asyncio.LimitOverrunError:
                await self._send(writer, protocol.error_body(protocol.too_large_message()))
                return
            if frame[:-1].strip():
                answer = await loop.run_in_executor(
                    self._executor, _answer, self.config.app_key, frame[:-1], address
                )
                await self._send(writer, answer)

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, answer: dict[str, Any]) -> None:
        writer.write(json.dumps(answer, separators=(",", ":")).encode() + b"\0")
        await writer.drain()


class Command(BaseCommand):
    help = "Serve unmodified UWPX clients: NUL-framed JSON over TLS (default port 1997)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--address",
            default=conf.current().uwpx_listen_address,
            help="Address to listen on (UWPX_LISTEN_ADDRESS; default 127.0.0.1).",
        )
        parser.add_argument(
            "--port",
            type=int,
            default=conf.current().uwpx_listen_port,
            help="TCP port (UWPX_LISTEN_PORT; the client dials 1997).",
        )
        parser.add_argument(
            "--app",
            default=conf.current().uwpx_listen_app,
            help="The app's public key (UWPX_LISTEN_APP).",
        )
        parser.add_argument(
            "--cert",
            default=conf.current().uwpx_tls_cert_file,
            help="PEM chain (UWPX_TLS_CERT_FILE).",
        )
        parser.add_argument(
            "--key", default=conf.current().uwpx_tls_key_file, help="PEM key (UWPX_TLS_KEY_FILE)."
        )
        parser.add_argument(
            "--idle-seconds",
            type=float,
            default=30.0,
            help="Close a connection that sends nothing for this long (default 30).",
        )
        parser.add_argument(
            "--max-connections",
            type=int,
            default=512,
            help="Connections served at once; more are closed at once (default 512).",
        )
        parser.add_argument(
            "--threads",
            type=int,
            default=8,
            help="Threads for the database work of the messages (default 8).",
        )
        parser.add_argument(
            "--idle-if-unconfigured",
            action="store_true",
            help="Without certificate or app, wait idly instead of failing (for the Procfile).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        config = ListenerConfig(
            address=options["address"],
            port=options["port"],
            app_key=options["app"],
            cert_file=options["cert"],
            key_file=options["key"],
            idle_seconds=options["idle_seconds"],
            max_connections=options["max_connections"],
            threads=options["threads"],
        )
        missing = [
            name
            for name, value in (
                ("UWPX_TLS_CERT_FILE", config.cert_file),
                ("UWPX_TLS_KEY_FILE", config.key_file),
                ("UWPX_LISTEN_APP", config.app_key),
            )
            if not value
        ]
        if missing:
            if options["idle_if_unconfigured"]:
                asyncio.run(_wait_for_stop(missing))
                return
            raise CommandError(f"The UWPX listener needs {', '.join(missing)} to be set.")
        try:
            context = tls_context(cert_file=config.cert_file, key_file=config.key_file)
        except (OSError, ssl.SSLError) as error:
            raise CommandError(f"Cannot load the TLS certificate or key: {error}") from error
        asyncio.run(UwpxListener(config, context).run())


async def _wait_for_stop(missing: list[str]) -> None:
    """Idle until told to stop. The line that says so is logged once the stop signals are
    handled: a supervisor that stops the listener as soon as it reads it gets a clean exit."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info("uwpx_listener.disabled", extra={"missing": missing})
    await stop.wait()
