"""A fake WNS on plain HTTP at 127.0.0.1: token endpoint and channel endpoints in one server.

It checks what the real service checks (form fields, client credentials, bearer token, the
raw-notification headers) and can be scripted per channel, so the real client is tested over a
real socket. Use it as a context manager, or start()/stop().
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qs

from tests.fakes import announce_and_serve

REQUIRED_CHANNEL_HEADERS = {
    "x-wns-type": "wns/raw",
    "content-type": "application/octet-stream",
    "x-wns-requestforstatus": "true",
}


@dataclass(frozen=True)
class FakeReply:
    """One scripted channel answer; `delay` sleeps before answering (for timeouts)."""

    status: int = 200
    wns_status: str | None = "received"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass(frozen=True)
class RecordedRequest:
    """A channel POST as the fake saw it (header names lower-cased)."""

    channel_id: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int  # what the fake answered
    received_at: float = field(default_factory=time.time)

    def json(self) -> object:
        return json.loads(self.body)


class FakeWns:
    """Threaded fake WNS. Tokens it issues are valid until revoke_tokens() or their lifetime."""

    def __init__(
        self,
        *,
        client_id: str = "ms-app://s-1-15-2-1111111111-2222222222-3333333333",
        client_secret: str = "fake-wns-secret",
        token_lifetime: int = 86400,
    ) -> None:
        self.client_id = client_id
        self.client_secret = client_secret
        self.token_lifetime = token_lifetime
        self.token_delay = 0.0
        self._lock = threading.Condition()
        self._tokens: dict[str, float] = {}  # token -> expiry (time.monotonic)
        self._token_requests: list[dict[str, str]] = []
        self._token_failures: deque[tuple[int, dict[str, object], dict[str, str]]] = deque()
        self._requests: list[RecordedRequest] = []
        self._scripts: defaultdict[str, deque[FakeReply]] = defaultdict(deque)
        self._defaults: dict[str, FakeReply] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --

    def start(self) -> FakeWns:
        fake = self

        class Handler(_Handler):
            owner = fake

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # concurrency tests connect many clients at once

        server = Server(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.block_on_close = False  # kept-alive client connections must not block stop()
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeWns:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- addresses --

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the fake first"
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def host_pattern(self) -> str:
        """The channel host pattern that allows exactly this fake."""
        return f"127.0.0.1:{self.port}"

    @property
    def token_url(self) -> str:
        return f"{self.base_url}/accesstoken.srf"

    def channel_uri(self, channel_id: str) -> str:
        return f"{self.base_url}/channel/{channel_id}?token={channel_id}-opaque"

    # -- scripting --

    def queue_replies(self, channel_id: str, *replies: FakeReply) -> None:
        """Answer the channel's next POSTs with these, in order, then with its default."""
        with self._lock:
            self._scripts[channel_id].extend(replies)

    def set_default_reply(self, channel_id: str, reply: FakeReply) -> None:
        with self._lock:
            self._defaults[channel_id] = reply

    def fail_token_requests(
        self,
        status: int,
        body: dict[str, object] | None = None,
        *,
        times: int = 1,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Answer the next `times` token requests with this error."""
        with self._lock:
            for _ in range(times):
                self._token_failures.append((status, body or {}, headers or {}))

    def revoke_tokens(self) -> None:
        """Invalidate every token issued so far: the next channel POST with one gets 401."""
        with self._lock:
            self._tokens.clear()

    # -- inspection --

    @property
    def token_requests(self) -> int:
        with self._lock:
            return len(self._token_requests)

    @property
    def token_forms(self) -> list[dict[str, str]]:
        with self._lock:
            return list(self._token_requests)

    @property
    def issued_tokens(self) -> list[str]:
        with self._lock:
            return list(self._tokens)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def requests_for(self, channel_id: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.channel_id == channel_id]

    def wait_for_requests(self, n: int, timeout: float = 30.0) -> list[RecordedRequest]:
        """Block until at least n channel POSTs arrived; AssertionError after `timeout`."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._requests) >= n, timeout):
                raise AssertionError(
                    f"fake WNS saw {len(self._requests)} channel requests, expected {n}"
                )
            return list(self._requests)

    # -- request handling (called from server threads) --

    def _token_answer(self, form: dict[str, str]) -> tuple[int, dict[str, object], dict[str, str]]:
        if self.token_delay:
            time.sleep(self.token_delay)
        with self._lock:
            self._token_requests.append(form)
            if self._token_failures:
                return self._token_failures.popleft()
            if form.get("grant_type") != "client_credentials":
                return 400, {"error": "unsupported_grant_type"}, {}
            if form.get("scope") != "notify.windows.com":
                return 400, {"error": "invalid_scope"}, {}
            if (
                form.get("client_id") != self.client_id
                or form.get("client_secret") != self.client_secret
            ):
                return 400, {"error": "invalid_client", "error_description": "bad creds"}, {}
            token = "fake-token-" + secrets.token_urlsafe(16)
            self._tokens[token] = time.monotonic() + self.token_lifetime
            answer = {
                "token_type": "bearer",
                "access_token": token,
                "expires_in": self.token_lifetime,
            }
            return 200, answer, {}

    def _channel_answer(
        self, channel_id: str, path: str, headers: dict[str, str], body: bytes
    ) -> FakeReply:
        with self._lock:
            reply = self._pick_reply(channel_id, headers)
            self._requests.append(RecordedRequest(channel_id, path, headers, body, reply.status))
            self._lock.notify_all()
        return reply

    def _pick_reply(self, channel_id: str, headers: dict[str, str]) -> FakeReply:
        auth = headers.get("authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
        expiry = self._tokens.get(token)
        if expiry is None or expiry <= time.monotonic():
            return FakeReply(
                401,
                None,
                {"WWW-Authenticate": 'Bearer error="invalid_request",error_description="Token"'},
            )
        for name, value in REQUIRED_CHANNEL_HEADERS.items():
            if headers.get(name) != value:
                return FakeReply(400, None, {"X-WNS-Error-Description": f"bad {name}"})
        if headers.get("x-wns-priority") not in {"1", "2", "3", "4"}:
            return FakeReply(400, None, {"X-WNS-Error-Description": "bad x-wns-priority"})
        script = self._scripts.get(channel_id)
        if script:
            return script.popleft()
        return self._defaults.get(channel_id, FakeReply())


class _Handler(BaseHTTPRequestHandler):
    owner: FakeWns
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    timeout = 10  # idle kept-alive connections end on their own

    def log_message(self, format: str, *args: object) -> None:
        """Silence the default stderr access log."""

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        try:
            self.end_headers()
            if body:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (a timeout test)

    def do_GET(self) -> None:
        """`GET /_fake/stats` (benchmarks): how many channel requests, and when."""
        if self.path != "/_fake/stats":
            self._answer(404, b"", {})
            return
        requests = self.owner.requests
        statuses: dict[str, int] = {}
        for request in requests:
            statuses[str(request.status)] = statuses.get(str(request.status), 0) + 1
        times = [request.received_at for request in requests]
        stats = {
            "sends": len(requests),
            "statuses": statuses,
            "first": min(times, default=0.0),
            "last": max(times, default=0.0),
            "times": sorted(times),
        }
        self._answer(200, json.dumps(stats).encode(), {"Content-Type": "application/json"})

    def do_POST(self) -> None:
        body = self._read_body()
        path = self.path.split("?", 1)[0]
        if path == "/accesstoken.srf":
            content_type = self.headers.get("Content-Type", "")
            if not content_type.startswith("application/x-www-form-urlencoded"):
                self._answer(400, b'{"error":"invalid_request"}', {})
                return
            parsed = parse_qs(body.decode(), keep_blank_values=True)
            form = {key: values[0] for key, values in parsed.items()}
            status, answer, headers = self.owner._token_answer(form)
            headers = {"Content-Type": "application/json", **headers}
            self._answer(status, json.dumps(answer).encode(), headers)
            return
        channel_id = path.rsplit("/", 1)[-1]
        headers = {name.lower(): value for name, value in self.headers.items()}
        reply = self.owner._channel_answer(channel_id, self.path, headers, body)
        if reply.delay:
            time.sleep(reply.delay)
        answer_headers = {"X-WNS-Msg-ID": secrets.token_hex(8), **reply.headers}
        if reply.status == 200 and reply.wns_status is not None:
            answer_headers["X-WNS-Status"] = reply.wns_status
            answer_headers["X-WNS-DeviceConnectionStatus"] = "connected"
        self._answer(reply.status, b"", answer_headers)


def main() -> None:
    """`python -m tests.fakes.wns`: prints its URLs and credentials as JSON (benchmarks)."""
    fake = FakeWns().start()
    info = {
        "base_url": fake.base_url,
        "token_url": fake.token_url,
        "host_pattern": fake.host_pattern,
        "client_id": fake.client_id,
        "client_secret": fake.client_secret,
    }
    announce_and_serve(info)
    fake.stop()


if __name__ == "__main__":
    main()
