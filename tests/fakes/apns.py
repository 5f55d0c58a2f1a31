"""A fake APNs: HTTP/2 over TLS (the `h2` package) on 127.0.0.1, for the real aioapns client.

It checks what Apple checks that matters to us (the ES256 provider token: signature, `kid`,
`iss`, age; the topic; the apns-id, priority and push type; optionally a client certificate),
records every request and answers 200 or a scripted error per device token. It runs its own
asyncio loop in a background thread, so tests drive it synchronously.

    key_pem, public_key = make_p8_key()
    with FakeApns(topic="org.example.app", public_key=public_key) as fake:
        config = ApnsConfig(topic=..., key=key_pem, key_id=fake.key_id, team_id=fake.team_id,
                            endpoint=fake.endpoint, ca_file=fake.ca_file)
        fake.respond(token, status=410, reason="Unregistered")
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import shutil
import ssl
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, DataReceived, RequestReceived, StreamEnded, StreamReset
from h2.exceptions import H2Error
from h2.settings import SettingCodes, Settings

from tests.fakes import announce_and_serve

PUSH_TYPES = frozenset(
    {"alert", "background", "voip", "complication", "fileprovider", "mdm", "liveactivity"}
)
MAX_PAYLOAD = 4096
TOKEN_MAX_AGE = 3600


# --- keys and certificates ----------------------------------------------------------------------


def _pem_key(key: Any) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def make_p8_key() -> tuple[str, ec.EllipticCurvePublicKey]:
    """An APNs auth key as Apple hands it out (.p8: PKCS#8 EC P-256) and its public half."""
    key = ec.generate_private_key(ec.SECP256R1())
    return _pem_key(key), key.public_key()


def _certificate(
    subject: x509.Name,
    public_key: Any,
    issuer: x509.Name,
    issuer_key: Any,
    *,
    ca: bool,
    not_before: datetime,
    not_after: datetime,
    extensions: list[x509.ExtensionType] = (),  # type: ignore[assignment]
) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _name(common_name: str, uid: str = "") -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if uid:
        attributes.insert(0, x509.NameAttribute(NameOID.USER_ID, uid))
    return x509.Name(attributes)


@dataclass(frozen=True)
class CertificateAuthority:
    """A throw-away CA: signs the fake's server certificate or clients' certificates."""

    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, name: str) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        subject = _name(name)
        cert = _certificate(
            subject,
            key.public_key(),
            subject,
            key,
            ca=True,
            not_before=now - timedelta(hours=1),
            not_after=now + timedelta(days=2),
            extensions=[
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                )
            ],
        )
        return cls(cert, key)

    @property
    def pem(self) -> str:
        return _pem_cert(self.certificate)


def make_client_certificate(
    topic: str = "org.example.app",
    *,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
    issuer: CertificateAuthority | None = None,
) -> tuple[str, str]:
    """An "Apple Push Services" client certificate and key (PEM); self-signed without issuer."""
    now = datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(f"Apple Push Services: {topic}", uid=topic)
    cert = _certificate(
        subject,
        key.public_key(),
        issuer.certificate.subject if issuer else subject,
        issuer.key if issuer else key,
        ca=False,
        not_before=not_before or now - timedelta(hours=1),
        not_after=not_after or now + timedelta(days=365),
        extensions=[x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH])],
    )
    return _pem_cert(cert), _pem_key(key)


def make_expired_certificate(topic: str = "org.example.app") -> tuple[str, str]:
    """A client certificate that expired yesterday, for validation tests."""
    now = datetime.now(UTC)
    return make_client_certificate(
        topic, not_before=now - timedelta(days=400), not_after=now - timedelta(days=1)
    )


def _server_certificate(ca: CertificateAuthority, host: str) -> tuple[str, str]:
    now = datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(
        _name(host),
        key.public_key(),
        ca.certificate.subject,
        ca.key,
        ca=False,
        not_before=now - timedelta(hours=1),
        not_after=now + timedelta(days=1),
        extensions=[
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(host))]
            ),
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
        ],
    )
    return _pem_cert(cert), _pem_key(key)


# --- records and scripts ------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the fake saw it, and what it answered."""

    token: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    connection: int
    status: int
    reason: str
    jwt_header: dict[str, Any] | None = None
    jwt_claims: dict[str, Any] | None = None
    client_subject: str = ""
    received_at: float = field(default_factory=time.time)

    @property
    def push_type(self) -> str:
        return self.headers.get("apns-push-type", "")

    @property
    def priority(self) -> str:
        return self.headers.get("apns-priority", "")


@dataclass
class _Script:
    status: int
    reason: str
    delay: float
    close_connection: bool
    times: int | None


@dataclass
class _Stream:
    headers: dict[str, str]
    data: bytearray = field(default_factory=bytearray)


class _ServerConnection(asyncio.Protocol):
    """One client connection: an h2 server state machine on a TLS transport."""

    def __init__(self, fake: FakeApns, number: int) -> None:
        self.fake = fake
        self.number = number
        self.transport: asyncio.Transport | None = None
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))
        self.streams: dict[int, _Stream] = {}
        self.client_subject = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("ssl_object")
        if peer is not None:
            der = peer.getpeercert(binary_form=True)
            if der:
                self.client_subject = x509.load_der_x509_certificate(der).subject.rfc4514_string()
        self.h2.local_settings = Settings(
            client=False,
            initial_values={SettingCodes.MAX_CONCURRENT_STREAMS: self.fake.max_concurrent_streams},
        )
        self.h2.initiate_connection()
        self.fake._opened(self)
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fake._closed(self)

    def flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except H2Error:
            self.flush()
            self.close()
            return
        for event in events:
            if isinstance(event, RequestReceived):
                self.streams[event.stream_id] = _Stream(dict(event.headers))  # type: ignore[arg-type]
            elif isinstance(event, DataReceived):
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream.data += event.data
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, StreamEnded):
                stream = self.streams.pop(event.stream_id, None)
                if stream is not None:
                    self._handle(event.stream_id, stream)
            elif isinstance(event, StreamReset):
                self.streams.pop(event.stream_id, None)
            elif isinstance(event, ConnectionTerminated):
                self.close()
        self.flush()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _handle(self, stream_id: int, stream: _Stream) -> None:
        record, script = self.fake._decide(stream, self)
        if script is not None and script.close_connection:
            self.close()
            return
        delay = script.delay if script is not None else 0.0
        apns_id = stream.headers.get("apns-id") or str(uuid.uuid4())
        if delay > 0:
            loop = asyncio.get_running_loop()
            loop.call_later(delay, self._answer, stream_id, apns_id, record.status, record.reason)
        else:
            self._answer(stream_id, apns_id, record.status, record.reason)

    def _answer(self, stream_id: int, apns_id: str, status: int, reason: str) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        headers = [(":status", str(status)), ("apns-id", apns_id)]
        try:
            if status == 200:
                self.h2.send_headers(stream_id, headers, end_stream=True)
            else:
                answer: dict[str, Any] = {"reason": reason}
                if status == 410:
                    answer["timestamp"] = int(time.time() * 1000)
                body = json.dumps(answer).encode()
                headers += [
                    ("content-type", "application/json"),
                    ("content-length", str(len(body))),
                ]
                self.h2.send_headers(stream_id, headers)
                self.h2.send_data(stream_id, body, end_stream=True)
        except H2Error:
            return  # the client reset the stream or went away
        self.flush()


class FakeApns:
    """An in-process APNs on 127.0.0.1; `start()`/`stop()` or use it as a context manager.

    Token auth is verified when `public_key` is given (the .p8 key's public half); with
    `client_certificates=True` the TLS handshake requires a certificate issued by
    `issue_client_certificate()`. With neither, requests are not authenticated.
    """

    def __init__(
        self,
        *,
        topic: str = "org.example.app",
        public_key: ec.EllipticCurvePublicKey | None = None,
        key_id: str = "KEYID12345",
        team_id: str = "TEAMID1234",
        client_certificates: bool = False,
        max_concurrent_streams: int = 1000,
    ) -> None:
        self.host = "127.0.0.1"
        self.topic = topic
        self.public_key = public_key
        self.key_id = key_id
        self.team_id = team_id
        self.client_certificates = client_certificates
        self.max_concurrent_streams = max_concurrent_streams
        self.port = 0
        self.client_ca = CertificateAuthority.create("Fake APNs client CA")
        self._cond = threading.Condition()
        self._requests: list[RecordedRequest] = []
        self._scripts: dict[str, list[_Script]] = {}
        self._connections: set[_ServerConnection] = set()
        self._connection_count = 0
        self._dir: Path | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None

    # lifecycle

    def start(self) -> FakeApns:
        self._dir = Path(tempfile.mkdtemp(prefix="fake-apns-"))
        server_ca = CertificateAuthority.create("Fake APNs server CA")
        cert_pem, key_pem = _server_certificate(server_ca, self.host)
        (self._dir / "ca.pem").write_text(server_ca.pem)
        (self._dir / "server.pem").write_text(cert_pem + key_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._dir / "server.pem")
        context.set_alpn_protocols(["h2"])
        if self.client_certificates:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cadata=self.client_ca.pem)

        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                self._loop.create_server(self._new_connection, self.host, 0, ssl=context)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fake-apns", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake APNs did not start")
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for connection in list(self._connections):
                if connection.transport is not None:
                    connection.transport.abort()
            for _ in range(3):
                await asyncio.sleep(0)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> FakeApns:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # what tests use

    @property
    def endpoint(self) -> str:
        """For `ApnsConfig.endpoint`."""
        return f"{self.host}:{self.port}"

    @property
    def ca_file(self) -> str:
        """The CA that signed the server certificate, for `ApnsConfig.ca_file`."""
        assert self._dir is not None, "start the fake first"
        return str(self._dir / "ca.pem")

    def issue_client_certificate(
        self, topic: str | None = None, *, not_after: datetime | None = None
    ) -> tuple[str, str]:
        """A client certificate (PEM) and key this fake accepts with `client_certificates`."""
        return make_client_certificate(
            topic or self.topic, not_after=not_after, issuer=self.client_ca
        )

    def respond(
        self,
        token: str,
        status: int = 200,
        reason: str = "",
        *,
        delay: float = 0.0,
        close_connection: bool = False,
        times: int | None = None,
    ) -> None:
        """Script the answer for `token` (`times` answers, or until reset); queued in order.

        `delay` holds the answer back; `close_connection` drops the connection unanswered.
        """
        with self._cond:
            self._scripts.setdefault(token, []).append(
                _Script(status, reason, delay, close_connection, times)
            )

    def reset(self) -> None:
        """Forget recorded requests and scripts (connections stay open)."""
        with self._cond:
            self._requests.clear()
            self._scripts.clear()

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._cond:
            return list(self._requests)

    def requests_for(self, token: str) -> list[RecordedRequest]:
        return [request for request in self.requests if request.token == token]

    @property
    def connection_count(self) -> int:
        """Connections accepted since start (a reused connection counts once)."""
        with self._cond:
            return self._connection_count

    @property
    def open_connections(self) -> int:
        with self._cond:
            return len(self._connections)

    def wait_for_requests(self, n: int, timeout: float = 30.0) -> list[RecordedRequest]:
        """Block until at least `n` requests were recorded; AssertionError on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._requests) >= n, timeout):
                raise AssertionError(f"fake APNs saw {len(self._requests)} requests, not {n}")
            return list(self._requests)

    def drop_connections(self) -> None:
        """Close every client connection, as Apple does now and then."""
        loop = self._loop
        if loop is None:
            return
        for connection in list(self._connections):
            loop.call_soon_threadsafe(connection.close)

    # server side

    def _new_connection(self) -> _ServerConnection:
        with self._cond:
            self._connection_count += 1
            return _ServerConnection(self, self._connection_count)

    def _opened(self, connection: _ServerConnection) -> None:
        with self._cond:
            self._connections.add(connection)

    def _closed(self, connection: _ServerConnection) -> None:
        with self._cond:
            self._connections.discard(connection)

    def _check_provider_token(
        self, headers: dict[str, str]
    ) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
        """Apple's 403 reason ("" if the bearer token is good), the JWT header and claims."""
        authorization = headers.get("authorization", "")
        if not authorization:
            return ("" if self.client_certificates else "MissingProviderToken"), None, None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return "InvalidProviderToken", None, None
        try:
            header = jwt.get_unverified_header(token)
            claims = jwt.decode(
                token,
                self.public_key,  # type: ignore[arg-type]
                algorithms=["ES256"],
                options={"require": ["iss", "iat"]},
            )
        except jwt.PyJWTError:
            return "InvalidProviderToken", None, None
        if header.get("kid") != self.key_id or claims.get("iss") != self.team_id:
            return "InvalidProviderToken", header, claims
        if time.time() - float(claims["iat"]) > TOKEN_MAX_AGE:
            return "ExpiredProviderToken", header, claims
        return "", header, claims

    def _decide(
        self, stream: _Stream, connection: _ServerConnection
    ) -> tuple[RecordedRequest, _Script | None]:
        headers = stream.headers
        method, path = headers.get(":method", ""), headers.get(":path", "")
        token = path.removeprefix("/3/device/") if path.startswith("/3/device/") else ""
        try:
            body = json.loads(stream.data) if stream.data else None
        except ValueError:
            body = None
        problem, jwt_header, jwt_claims = (
            self._check_provider_token(headers) if self.public_key is not None else ("", None, None)
        )
        status, reason = 200, ""
        script: _Script | None = None
        apns_id = headers.get("apns-id", "")

        if method != "POST":
            status, reason = 405, "MethodNotAllowed"
        elif not token:
            status, reason = 404, "BadPath"
        elif problem:
            status, reason = 403, problem
        elif not headers.get("apns-topic"):
            status, reason = 400, "MissingTopic"
        elif headers["apns-topic"] != self.topic:
            status, reason = 400, "DeviceTokenNotForTopic"
        elif apns_id and not _is_uuid(apns_id):
            status, reason = 400, "BadMessageId"
        elif headers.get("apns-priority", "10") not in ("1", "5", "10"):
            status, reason = 400, "BadPriority"
        elif headers.get("apns-push-type", "alert") not in PUSH_TYPES:
            status, reason = 400, "InvalidPushType"
        elif not stream.data:
            status, reason = 400, "PayloadEmpty"
        elif len(stream.data) > MAX_PAYLOAD:
            status, reason = 413, "PayloadTooLarge"
        elif body is None or not isinstance(body, dict):
            status, reason = 400, "BadPayload"  # not an Apple reason; a bug on our side
        with self._cond:
            if status == 200:
                script = self._next_script(token)
                if script is not None:
                    status, reason = script.status, script.reason
            record = RecordedRequest(
                token=token,
                method=method,
                path=path,
                headers={k: v for k, v in headers.items() if not k.startswith(":")},
                body=body,
                connection=connection.number,
                status=status,
                reason=reason,
                jwt_header=jwt_header,
                jwt_claims=jwt_claims,
                client_subject=connection.client_subject,
            )
            self._requests.append(record)
            self._cond.notify_all()
        return record, script

    def _next_script(self, token: str) -> _Script | None:
        """Called with the lock held."""
        queue = self._scripts.get(token)
        if not queue:
            return None
        script = queue[0]
        if script.times is not None:
            script.times -= 1
            if script.times <= 0:
                queue.pop(0)
        return script


def _is_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value.lower()
    except ValueError:
        return False


# --- as a process (benchmarks) -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """`python -m tests.fakes.apns --write-key /tmp/apns.p8`: prints the endpoint, CA file and
    key ids as JSON; `GET /stats` on the printed control URL counts requests."""
    import argparse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parser = argparse.ArgumentParser(description="A fake APNs (HTTP/2) for benchmarks")
    parser.add_argument("--topic", default="org.example.app")
    parser.add_argument("--write-key", metavar="PATH", required=True)
    args = parser.parse_args(argv)
    key_pem, public_key = make_p8_key()
    Path(args.write_key).write_text(key_pem)
    Path(args.write_key).chmod(0o600)
    fake = FakeApns(topic=args.topic, public_key=public_key).start()

    class Control(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            requests = fake.requests
            statuses: dict[str, int] = {}
            for request in requests:
                statuses[str(request.status)] = statuses.get(str(request.status), 0) + 1
            times = [request.received_at for request in requests]
            body = json.dumps(
                {
                    "sends": len(requests),
                    "statuses": statuses,
                    "first": min(times, default=0.0),
                    "last": max(times, default=0.0),
                    "times": sorted(times),
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    control = ThreadingHTTPServer(("127.0.0.1", 0), Control)
    threading.Thread(target=control.serve_forever, daemon=True).start()
    info = {
        "endpoint": fake.endpoint,
        "ca_file": fake.ca_file,
        "key_id": fake.key_id,
        "team_id": fake.team_id,
        "topic": fake.topic,
        "control": f"http://127.0.0.1:{control.server_address[1]}",
    }
    announce_and_serve(info)
    control.shutdown()
    fake.stop()


if __name__ == "__main__":
    main()
