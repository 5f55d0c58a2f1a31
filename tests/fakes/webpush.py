"""A fake Web Push service (RFC 8030) on plain HTTP at 127.0.0.1, checking what a real one
checks and reading every message as the browser would.

- VAPID (RFC 8292): `Authorization: vapid t=<JWT>,k=<key>`; the JWT's audience is the
  endpoint's origin, its expiry within 24 hours, its ES256 signature by the `k` key; a `sub`.
- The message (RFC 8291): `Content-Encoding: aes128gcm`, a `TTL`; the body is decrypted with the
  subscription's private key and auth secret (`http_ece.decrypt`), as a browser does.

A subscription is made by `subscribe()` (what PushManager.subscribe gives the client: the
endpoint and its p256dh and auth keys); answers can be scripted per subscription.
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import http_ece
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from tests.fakes import announce_and_serve

MAX_JWT_LIFETIME = 24 * 3600


def b64decode(value: str) -> bytes:
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))


def b64encode(value: bytes) -> str:
    return base64.urlsafe_b64encode(value).rstrip(b"=").decode()


@dataclass(frozen=True)
class FakeSubscription:
    """A client's subscription: the endpoint, its public keys, and the private key the fake
    decrypts with."""

    id: str
    endpoint: str
    p256dh: str
    auth: str
    private_key: ec.EllipticCurvePrivateKey = field(repr=False)

    def fields(self) -> dict[str, str]:
        """The registration command's form fields."""
        return {"endpoint": self.endpoint, "p256dh": self.p256dh, "auth": self.auth}

    def token(self) -> str:
        """The registration's token, as the relay stores it."""
        info = {"endpoint": self.endpoint, "keys": {"p256dh": self.p256dh, "auth": self.auth}}
        return json.dumps(info, separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class FakeReply:
    status: int = 201
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass(frozen=True)
class Received:
    """A message as the fake saw it: headers lower-cased, the JWT's claims, the plain text."""

    subscription_id: str
    headers: dict[str, str]
    claims: dict[str, Any]
    vapid_key: str
    plaintext: bytes
    status: int
    received_at: float = field(default_factory=time.time)

    def payload(self) -> Any:
        return json.loads(self.plaintext)


class Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def verify_vapid(authorization: str, origin: str) -> tuple[dict[str, Any], str]:
    """The claims and key of a valid `vapid t=…,k=…` header for `origin`; Refused if not."""
    scheme, _, rest = authorization.partition(" ")
    if scheme.lower() != "vapid":
        raise Refused(401, "not a vapid authorization")
    parts = dict(item.strip().split("=", 1) for item in rest.split(",") if "=" in item)
    token, key = parts.get("t", ""), parts.get("k", "")
    try:
        public = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), b64decode(key))
        header_b64, claims_b64, signature_b64 = token.split(".")
        header = json.loads(b64decode(header_b64))
        claims = json.loads(b64decode(claims_b64))
        signature = b64decode(signature_b64)
    except ValueError as error:
        raise Refused(401, f"malformed vapid header: {error}") from None
    if header.get("alg") != "ES256" or len(signature) != 64:
        raise Refused(401, "the JWT must be ES256")
    der = encode_dss_signature(
        int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
    )
    try:
        public.verify(der, f"{header_b64}.{claims_b64}".encode(), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise Refused(403, "the JWT is not signed by the k key") from None
    if claims.get("aud") != origin:
        raise Refused(403, f"audience {claims.get('aud')!r} is not {origin!r}")
    now = time.time()
    if not isinstance(claims.get("exp"), int) or not now < claims["exp"] <= now + MAX_JWT_LIFETIME:
        raise Refused(403, "exp must be within 24 hours")
    if not str(claims.get("sub", "")).startswith(("mailto:", "https://")):
        raise Refused(403, "sub must be a mailto: or https: contact")
    return claims, key


class FakePushService:
    def __init__(self, *, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: served over HTTPS with this server context."""
        self.tls = tls
        self._lock = threading.Condition()
        self._subscriptions: dict[str, FakeSubscription] = {}
        self._received: list[Received] = []
        self._refusals: list[tuple[str, int, str]] = []
        self._scripts: defaultdict[str, deque[FakeReply]] = defaultdict(deque)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --

    def start(self) -> FakePushService:
        fake = self

        class Handler(_Handler):
            owner = fake

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.block_on_close = False
        if self.tls is not None:  # a failed handshake is dropped at accept, as a refusal
            server.socket = self.tls.wrap_socket(server.socket, server_side=True)
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

    def __enter__(self) -> FakePushService:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- addresses and subscriptions --

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        return self._server.server_address[1]

    @property
    def origin(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def host_pattern(self) -> str:
        """The endpoint host pattern that allows this fake (loopback, any port)."""
        return "127.0.0.1:*"

    def subscribe(self) -> FakeSubscription:
        private_key = ec.generate_private_key(ec.SECP256R1())
        public = private_key.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
        sub_id = secrets.token_urlsafe(12)
        subscription = FakeSubscription(
            id=sub_id,
            endpoint=f"{self.origin}/push/{sub_id}",
            p256dh=b64encode(public),
            auth=b64encode(secrets.token_bytes(16)),
            private_key=private_key,
        )
        with self._lock:
            self._subscriptions[sub_id] = subscription
        return subscription

    def script(self, subscription: FakeSubscription, *replies: FakeReply) -> None:
        """The next answers for this subscription, in order (then 201 again)."""
        with self._lock:
            self._scripts[subscription.id].extend(replies)

    # -- what was received --

    @property
    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    @property
    def refusals(self) -> list[tuple[str, int, str]]:
        with self._lock:
            return list(self._refusals)

    def received_for(self, subscription: FakeSubscription) -> list[Received]:
        return [r for r in self.received if r.subscription_id == subscription.id]

    def wait_for(self, count: int, timeout: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._received) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{len(self._received)} of {count} messages received")
                self._lock.wait(left)
            return list(self._received)

    # -- handling --

    def _handle(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict]:
        sub_id = path.rsplit("/", 1)[-1]
        with self._lock:
            subscription = self._subscriptions.get(sub_id)
            script = self._scripts[sub_id]
            reply = script.popleft() if script else FakeReply()
        if subscription is None or not path.startswith("/push/"):
            return 404, {}
        try:
            if headers.get("content-encoding") != "aes128gcm":
                raise Refused(400, "Content-Encoding must be aes128gcm")
            if not headers.get("ttl", "").isdigit():
                raise Refused(400, "a TTL header is required")
            claims, key = verify_vapid(headers.get("authorization", ""), self.origin)
            try:
                plaintext = http_ece.decrypt(
                    body,
                    private_key=subscription.private_key,
                    auth_secret=b64decode(subscription.auth),
                    version="aes128gcm",
                )
            except Exception as error:
                raise Refused(400, f"cannot decrypt: {type(error).__name__}") from None
        except Refused as refused:
            with self._lock:
                self._refusals.append((sub_id, refused.status, refused.reason))
                self._lock.notify_all()
            return refused.status, {}
        if reply.delay:
            time.sleep(reply.delay)
        with self._lock:
            self._received.append(Received(sub_id, headers, claims, key, plaintext, reply.status))
            self._lock.notify_all()
        extra = dict(reply.headers)
        if reply.status == 201:
            extra.setdefault("Location", f"{self.origin}/message/{secrets.token_hex(8)}")
        return reply.status, extra


class _Handler(BaseHTTPRequestHandler):
    owner: FakePushService
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, status: int, extra: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for name, value in extra.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def do_GET(self) -> None:
        """`GET /_fake/stats` (benchmarks): how many messages were read, and when."""
        if self.path != "/_fake/stats":
            self._answer(404, {})
            return
        times = sorted(message.received_at for message in self.owner.received)
        stats = {"sends": len(times), "refusals": len(self.owner.refusals), "times": times}
        self._answer(200, {"Content-Type": "application/json"}, json.dumps(stats).encode())

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.path == "/_fake/subscribe":
            # Benchmarks: `{"count": n}` makes n subscriptions and answers their tokens.
            count = int(json.loads(body or b"{}").get("count", 1))
            tokens = [self.owner.subscribe().token() for _ in range(count)]
            self._answer(200, {"Content-Type": "application/json"}, json.dumps(tokens).encode())
            return
        headers = {name.lower(): value for name, value in self.headers.items()}
        status, extra = self.owner._handle(self.path, headers, body)
        self._answer(status, extra)


def main() -> None:
    """`python -m tests.fakes.webpush`: prints its origin and host pattern as JSON
    (benchmarks), then serves until SIGTERM."""
    fake = FakePushService().start()
    announce_and_serve({"origin": fake.origin, "host_pattern": fake.host_pattern})
    fake.stop()


if __name__ == "__main__":
    main()
