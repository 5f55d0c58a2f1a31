"""The gateway's and the worker's small HTTP listener: /healthz, /readyz and /metrics.

Neither process serves HTTP otherwise, and an orchestrator (compose's healthcheck, a load
balancer, Prometheus) needs to ask each one. Thin: the checks are relay/services/health.py,
the metrics relay/metrics.py. Standard library only, one thread per request, so a slow
readiness check (a database that does not answer) never blocks the process's own work.

Where it listens comes from the settings (GATEWAY_PROBE_LISTEN, WORKER_PROBE_LISTEN); a port
already taken is logged as an error and the process goes on without its listener: the relay's
work matters more than its probes, and the missing probe says so to whoever asks.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from django.db import connections

from relay import conf, metrics

log = logging.getLogger(__name__)

Readiness = Callable[[], dict[str, bool]]


def parse_listen(value: str) -> tuple[str, int] | None:
    """ "host:port" ("[::1]:9101" for IPv6) -> (host, port); empty -> None (no listener)."""
    value = value.strip()
    if not value:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]"), int(port)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/healthz":
                self._json(200, {"status": "ok"})
            elif path == "/readyz":
                checks = self.server.readiness()
                ready = all(checks.values())
                status = "ok" if ready else "unavailable"
                self._json(200 if ready else 503, {"status": status, "checks": checks})
            elif path == "/metrics":
                self._metrics()
            else:
                self._json(404, {"status": "not found"})
        finally:
            connections.close_all()  # this request's thread ends: so does its connection

    def _metrics(self) -> None:
        authorization = self.headers.get("Authorization", "")
        if not metrics.token_accepted(conf.current().metrics_token, authorization):
            self._send(401, "application/json", b"{}", [("WWW-Authenticate", "Bearer")])
            return
        self._send(200, metrics.CONTENT_TYPE, metrics.render(metrics.registry()))

    def _json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, "application/json", json.dumps(body).encode())

    def _send(
        self, status: int, content_type: str, body: bytes, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds would drown the process's own log: none."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], readiness: Readiness) -> None:
        self.readiness = readiness
        if ":" in address[0]:
            import socket

            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class ProbeServer:
    """The listener of one process; `start` returns the bound port (None when off)."""

    def __init__(self, name: str, listen: str, readiness: Readiness) -> None:
        self.name = name
        self.listen = listen
        self.readiness = readiness
        self._server: _Server | None = None

    def start(self) -> int | None:
        address = parse_listen(self.listen)
        if address is None:
            return None
        try:
            self._server = _Server(address, self.readiness)
        except OSError as error:
            log.error(
                "probes.listen_failed",
                extra={"listener": self.name, "address": self.listen, "error": str(error)},
            )
            return None
        port = self._server.server_address[1]
        threading.Thread(
            target=self._server.serve_forever, name=f"{self.name}-probes", daemon=True
        ).start()
        log.info(
            "probes.listening", extra={"listener": self.name, "host": address[0], "port": port}
        )
        return port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
