"""A fake FCM HTTP v1 + Google OAuth token server that speaks the real wire protocol.

There is no internet here, so the real firebase-admin/google-auth clients talk to this instead:
- `POST /token`: google-auth's JWT-bearer grant. The assertion's RS256 signature is checked
  against the registered service account's public key; the answer is a Bearer access token.
- `POST /v1/projects/<project>/messages:send`: checks the Bearer token (and its project),
  validates the message roughly as FCM does, records it and answers `{"name": ...}`, or an
  error in the real v1 shape that firebase-admin maps to UnregisteredError, QuotaExceededError...

In-process: `with FakeFcm() as fake: sa = fake.service_account()`. As a process (benchmarks):
`python -m tests.fakes.fcm --port 8089 --write-service-account /tmp/sa.json`; it is scripted
over `POST /_fake/respond`, `POST /_fake/reset`, `GET /_fake/stats`, `GET /_fake/requests`.

An asyncio loop, HTTP/1.1 keep-alive, Nagle off (asyncio's default) and one write per response
keep it at thousands of requests/s (about 4-5k/s on 2 cores with the load generator beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import itertools
import json
import re
import secrets
import ssl
import sys
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.fakes import announce_and_serve
from tests.support.waiting import holds_for

GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
JWT_GRANT_TYPE = "urn:ietf:params:oauth:grant-type:jwt-bearer"
FCM_ERROR_TYPE = "type.googleapis.com/google.firebase.fcm.v1.FcmError"
BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"
# Either scope lets a service account send (firebase-admin asks for cloud-platform and more).
SEND_SCOPES = frozenset(
    {
        "https://www.googleapis.com/auth/cloud-platform",
        "https://www.googleapis.com/auth/firebase.messaging",
    }
)
STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}
# FCM's errorCode for a status when a test does not name one.
DEFAULT_ERROR_CODES = {
    400: "INVALID_ARGUMENT",
    404: "UNREGISTERED",
    429: "QUOTA_EXCEEDED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}
DEFAULT_MESSAGES = {
    "INVALID_ARGUMENT": "The registration token is not a valid FCM registration token",
    "UNREGISTERED": "Requested entity was not found.",
    "SENDER_ID_MISMATCH": "SenderId mismatch",
    "QUOTA_EXCEEDED": "Quota exceeded for quota metric 'Messages per device'.",
    "THIRD_PARTY_AUTH_ERROR": "Auth error from APNS or Web Push Service",
    "INTERNAL": "Internal error encountered.",
    "UNAVAILABLE": "The service is currently unavailable.",
    "UNAUTHENTICATED": "Request had invalid authentication credentials. Expected OAuth 2 "
    "access token, login cookie or other valid authentication credential.",
}
_SEND_PATH = re.compile(r"^/v1/projects/([^/]+)/messages:send$")
_MESSAGE_FIELDS = frozenset(
    {"name", "data", "notification", "android", "webpush", "apns", "fcm_options"}
    | {"token", "topic", "condition", "fid"}
)
_TARGETS = ("token", "topic", "condition", "fid")
_ANDROID_FIELDS = frozenset(
    {"collapse_key", "priority", "ttl", "restricted_package_name", "data", "notification"}
    | {"fcm_options", "direct_boot_ok", "bandwidth_constrained_ok", "restricted_satellite_ok"}
)
_PRIORITIES = frozenset({"normal", "high", "NORMAL", "HIGH"})


def new_private_key_pem() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


@functools.cache
def _shared_private_key_pem() -> str:
    return new_private_key_pem()


def make_service_account(
    token_uri: str, project_id: str = "test-project", *, private_key_pem: str | None = None
) -> dict[str, Any]:
    """A service-account dict as the Google console writes it, with a fresh RSA key unless
    `private_key_pem` is given (key generation is the slow part of a test's setup)."""
    pem = private_key_pem or new_private_key_pem()
    name = f"relay-{secrets.token_hex(4)}"
    return {
        "type": "service_account",
        "project_id": project_id,
        "private_key_id": secrets.token_hex(20),
        "private_key": pem,
        "client_email": f"{name}@{project_id}.iam.gserviceaccount.com",
        "client_id": str(secrets.randbelow(10**20)),
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": token_uri,
        "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs",
        "client_x509_cert_url": "https://www.googleapis.com/robot/v1/metadata/x509/"
        + urllib.parse.quote(f"{name}@{project_id}.iam.gserviceaccount.com"),
        "universe_domain": "googleapis.com",
    }


def write_service_account(service_account: dict[str, Any], path: str | Path) -> Path:
    """Write it as a JSON key file (mode 0600, like a downloaded key should be)."""
    path = Path(path)
    path.write_text(json.dumps(service_account, indent=2))
    path.chmod(0o600)
    return path


@dataclass(frozen=True)
class RecordedSend:
    """One `messages:send` request as it arrived (header names lower-cased), and its status."""

    project: str
    message: dict[str, Any]
    headers: dict[str, str]
    time: float
    status: int
    body: dict[str, Any] = field(default_factory=dict)

    @property
    def token(self) -> str | None:
        return self.message.get("token")


@dataclass(frozen=True)
class TokenGrant:
    client_email: str
    scope: str
    time: float


@dataclass
class _Script:
    status: int
    body: dict[str, Any] | list[Any]
    headers: dict[str, str]
    delay: float
    times: int | None


@dataclass(frozen=True)
class _Reply:
    status: int
    body: dict[str, Any] | list[Any]
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass(frozen=True)
class _Account:
    project_id: str
    key_id: str
    public_key: Any


@dataclass(frozen=True)
class _AccessToken:
    client_email: str
    project_id: str
    expires_at: float


def fcm_error_body(
    status: int, error_code: str = "", message: str = "", field_name: str = ""
) -> dict[str, Any]:
    """The v1 error document: `{"error": {"code", "message", "status", "details"}}`."""
    details: list[dict[str, Any]] = []
    if error_code:
        details.append({"@type": FCM_ERROR_TYPE, "errorCode": error_code})
    text = message or DEFAULT_MESSAGES.get(error_code or STATUS_NAMES.get(status, ""), "")
    if field_name:
        details.append(
            {
                "@type": BAD_REQUEST_TYPE,
                "fieldViolations": [{"field": field_name, "description": text}],
            }
        )
    error: dict[str, Any] = {
        "code": status,
        "message": text or f"HTTP {status}",
        "status": STATUS_NAMES.get(status, "UNKNOWN"),
    }
    if details:
        error["details"] = details
    return {"error": error}


def _invalid_message(payload: Any) -> tuple[str, str] | None:
    """(field, description) of the first thing real FCM would refuse, or None."""
    if not isinstance(payload, dict) or not isinstance(payload.get("message"), dict):
        return "message", "Invalid JSON payload received. 'message' is required."
    for name in payload:
        if name not in ("message", "validate_only"):
            return name, f'Invalid JSON payload received. Unknown name "{name}": Cannot find field.'
    message = payload["message"]
    for name in message:
        if name not in _MESSAGE_FIELDS:
            return f"message.{name}", f"Unknown name \"{name}\" at 'message': Cannot find field."
    if sum(1 for name in _TARGETS if message.get(name)) != 1:
        return "message", "Exactly one of token, topic, condition or fid must be set."
    data = message.get("data", {})
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        return "message.data", "Invalid value at 'message.data': values must be strings."
    android = message.get("android", {})
    if not isinstance(android, dict):
        return "message.android", "Invalid value at 'message.android'."
    for name in android:
        if name not in _ANDROID_FIELDS:
            return f"message.android.{name}", f"Unknown name \"{name}\" at 'message.android'."
    if "priority" in android and android["priority"] not in _PRIORITIES:
        return (
            "message.android.priority",
            "Invalid value at 'message.android.priority' "
            "(type.googleapis.com/google.firebase.fcm.v1.AndroidMessagePriority)",
        )
    return None


def _encode(reply: _Reply, keep_alive: bool) -> bytes:
    """One buffer per response: headers and body leave in a single write."""
    data = json.dumps(reply.body).encode()
    try:
        phrase = HTTPStatus(reply.status).phrase
    except ValueError:
        phrase = "Unknown"
    lines = [
        f"HTTP/1.1 {reply.status} {phrase}",
        "Content-Type: application/json; charset=UTF-8",
        f"Content-Length: {len(data)}",
    ]
    lines += [f"{name}: {value}" for name, value in reply.headers.items()]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


class FakeFcm:
    """FCM v1 + OAuth on 127.0.0.1, served by an asyncio loop in a daemon thread.

    `url` is the FCM endpoint to configure (`FcmConfig.endpoint`), `token_uri` the OAuth URL a
    service account must carry (`service_account()` makes and registers one). Every public
    method is thread-safe. The HTTP/1.1 server is minimal on purpose (keep-alive,
    Content-Length bodies, no chunked uploads): enough for requests/urllib3 and httpx, and
    several thousand requests/s.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        record: bool = True,
        token_lifetime: int = 3600,
        token_path: str = "/token",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls`: served over HTTPS with this server context (sends and token grants)."""
        self.host = host
        self.tls = tls
        self.record = record
        self.token_lifetime = token_lifetime
        self.token_path = token_path
        self._requested_port = port
        self._port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        # Each connection's number, for `open_connections`: never reused, unlike id(writer),
        # which a new connection's writer takes over once a closed one's is freed.
        self._numbers: dict[asyncio.StreamWriter, int] = {}
        self._accepted = itertools.count()
        self._cond = threading.Condition()
        self._accounts: dict[str, _Account] = {}
        self._access_tokens: dict[str, _AccessToken] = {}
        self._scripts: dict[str | None, list[_Script]] = {}
        self._sends: list[RecordedSend] = []
        self._grants: list[TokenGrant] = []
        self._statuses: Counter[int] = Counter()
        self._send_count = 0
        self._message_ids = 0

    # --- lifecycle

    def start(self) -> FakeFcm:
        if self._thread is not None:
            return self
        loop = asyncio.new_event_loop()
        started: concurrent.futures.Future[int] = concurrent.futures.Future()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(
                        self._serve, self.host, self._requested_port, backlog=512, ssl=self.tls
                    )
                )
            except BaseException as exc:
                started.set_exception(exc)
                return
            started.set_result(int(self._server.sockets[0].getsockname()[1]))
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="fake-fcm", daemon=True)
        self._thread.start()
        try:
            self._port = started.result(timeout=10)
        except BaseException:
            self._thread.join(timeout=5)
            self._thread = self._loop = None
            loop.close()
            raise
        return self

    def stop(self) -> None:
        """Stop listening and cut open keep-alive connections (a stopped FCM refuses)."""
        thread, loop, self._thread, self._loop = self._thread, self._loop, None, None
        if thread is None or loop is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            with self._cond:
                writers = list(self._writers)
            for writer in writers:
                writer.transport.abort()
            # Connections still inside a scripted delay: end them here, not as "Task was
            # destroyed but it is pending!" when the loop closes.
            serving = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in serving:
                task.cancel()
            await asyncio.gather(*serving, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()
        self._server = None

    def __enter__(self) -> FakeFcm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("FakeFcm was never started")
        return self._port

    @property
    def url(self) -> str:
        """The FCM endpoint (what `FcmConfig.endpoint` takes)."""
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def token_uri(self) -> str:
        return self.url + self.token_path

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._cond:
            self._writers.add(writer)
            self._numbers[writer] = next(self._accepted)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.decode("latin-1").split("\r\n")
                    method, target, version = lines[0].split(" ", 2)
                    headers: dict[str, str] = {}
                    for line in lines[1:]:
                        if line:
                            name, _, value = line.partition(":")
                            headers[name.strip().lower()] = value.strip()
                    if "chunked" in headers.get("transfer-encoding", "").lower():
                        writer.write(_encode(_Reply(411, {"error": "chunked"}), False))
                        break
                    length = int(headers.get("content-length") or 0)
                    body = await reader.readexactly(length) if length else b""
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                    break
                connection = headers.get("connection", "").lower()
                keep_alive = (version == "HTTP/1.1" and connection != "close") or (
                    connection == "keep-alive"
                )
                reply = self._dispatch(method, target, headers, body)
                if reply.delay:
                    await asyncio.sleep(reply.delay)
                writer.write(_encode(reply, keep_alive))
                await writer.drain()
                if not keep_alive:
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass  # cut by the client, or by stop(): either way this connection is over
        finally:
            with self._cond:
                self._writers.discard(writer)
                self._numbers.pop(writer, None)
                self._cond.notify_all()
            writer.close()

    def _dispatch(self, method: str, target: str, headers: dict[str, str], body: bytes) -> _Reply:
        path = target.split("?", 1)[0]
        if method == "POST":
            match = _SEND_PATH.match(path)
            if match:
                return self._handle_send(urllib.parse.unquote(match.group(1)), headers, body)
            if path == self.token_path:
                return self._handle_token(body)
            if path.startswith("/_fake/"):
                return self._handle_control(path, body)
        elif method == "GET" and path == "/_fake/stats":
            return _Reply(200, self.stats())
        elif method == "GET" and path == "/_fake/requests":
            # For benchmarks: when each token's send arrived (epoch seconds), in arrival order.
            return _Reply(200, [{"token": r.token, "time": r.time} for r in self.requests])
        return _Reply(404, fcm_error_body(404, message="Not Found"))

    # --- credentials

    def register_service_account(self, service_account: dict[str, Any]) -> None:
        """Trust this account's key for JWT grants (its token_uri should point here)."""
        key = serialization.load_pem_private_key(
            service_account["private_key"].encode(),
            password=None,
            unsafe_skip_rsa_key_validation=True,  # our own fresh key; validation costs ~60 ms
        )
        with self._cond:
            self._accounts[service_account["client_email"]] = _Account(
                project_id=service_account["project_id"],
                key_id=service_account.get("private_key_id", ""),
                public_key=key.public_key(),
            )

    def service_account(
        self, project_id: str = "test-project", *, fresh_key: bool = False
    ) -> dict[str, Any]:
        """A new service account whose token_uri is this fake, already registered.

        Its client_email is new; the RSA key is shared within the process unless `fresh_key`.
        """
        pem = None if fresh_key else _shared_private_key_pem()
        account = make_service_account(self.token_uri, project_id, private_key_pem=pem)
        self.register_service_account(account)
        return account

    def revoke_access_tokens(self) -> None:
        """Forget issued tokens: the next send gets 401 and google-auth must fetch a new one."""
        with self._cond:
            self._access_tokens.clear()

    # --- scripting

    def respond(
        self,
        token: str | None,
        status: int = 200,
        error_code: str | None = None,
        message: str = "",
        *,
        retry_after: float | str | None = None,
        times: int | None = None,
        delay: float = 0.0,
        field: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        """Script the answer for sends to `token` (None: any token without its own script).

        `error_code` defaults per status (404 UNREGISTERED, 429 QUOTA_EXCEEDED, 400
        INVALID_ARGUMENT, 500 INTERNAL, 503 UNAVAILABLE); "" leaves out the FcmError detail.
        `field` adds a google.rpc.BadRequest violation (e.g. "message.token"). `times=None`
        answers until `clear_responses()`; otherwise scripts for a token are used in order.
        `delay` holds the answer back (timeouts). Auth is checked before any script applies.
        """
        if status < 300:
            body: dict[str, Any] = {}
        else:
            code = DEFAULT_ERROR_CODES.get(status, "") if error_code is None else error_code
            body = fcm_error_body(status, code, message, field)
        extra = dict(headers or {})
        if retry_after is not None:
            extra["Retry-After"] = str(retry_after)
        script = _Script(status, body, extra, delay, times)
        with self._cond:
            self._scripts.setdefault(token, []).append(script)

    def clear_responses(self) -> None:
        with self._cond:
            self._scripts.clear()

    def reset(self) -> None:
        """Forget scripts and recorded requests (keeps accounts and issued tokens)."""
        with self._cond:
            self._scripts.clear()
            self._sends.clear()
            self._grants.clear()
            self._statuses.clear()
            self._send_count = 0

    # --- what happened

    @property
    def requests(self) -> list[RecordedSend]:
        """Every messages:send request so far (whatever it was answered)."""
        with self._cond:
            return list(self._sends)

    def requests_for(self, token: str) -> list[RecordedSend]:
        return [r for r in self.requests if r.token == token]

    @property
    def send_count(self) -> int:
        with self._cond:
            return self._send_count

    @property
    def token_grants(self) -> list[TokenGrant]:
        """Every access token issued, in order."""
        with self._cond:
            return list(self._grants)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "sends": self._send_count,
                "token_grants": len(self._grants),
                "statuses": {str(k): v for k, v in sorted(self._statuses.items())},
            }

    def open_connections(self) -> frozenset[int]:
        """Which client connections are open now (opaque ids for `wait_closed`)."""
        with self._cond:
            return frozenset(self._numbers.values())

    def wait_closed(self, connections: frozenset[int], timeout: float = 30.0) -> None:
        """Block until every one of `connections` has closed.

        A connection closes here only after its last byte was read, so once a killed client's
        connections are closed, every request it wrote before it died has been recorded.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while connections & set(self._numbers.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("fake FCM: connections still open")
                self._cond.wait(left)

    def quiet_for(self, seconds: float) -> bool:
        """Whether no new send arrives within `seconds` (what was in flight has ended)."""
        before = self.send_count
        try:
            holds_for(lambda: self.send_count == before, seconds)
        except AssertionError:
            return False
        return True

    def wait_for_requests(self, n: int, timeout: float = 30.0) -> list[RecordedSend]:
        """Block until at least `n` sends arrived; all of them, or TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._send_count < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"fake FCM got {self._send_count} of {n} sends")
                self._cond.wait(left)
            return list(self._sends)

    # --- handlers (called on the server's threads)

    def _handle_token(self, body: bytes) -> _Reply:
        form = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
        grant_type = form.get("grant_type", [""])[0]
        assertion = form.get("assertion", [""])[0]
        if grant_type != JWT_GRANT_TYPE:
            return _oauth_error("unsupported_grant_type", f"Invalid grant_type: {grant_type}")
        try:
            header = jwt.get_unverified_header(assertion)
            unverified = jwt.decode(assertion, options={"verify_signature": False})
        except jwt.PyJWTError:
            return _oauth_error("invalid_grant", "Invalid JWT.")
        with self._cond:
            account = self._accounts.get(str(unverified.get("iss", "")))
        if account is None:
            return _oauth_error("invalid_grant", "Invalid grant: account not found")
        if account.key_id and header.get("kid") not in (None, account.key_id):
            return _oauth_error("invalid_grant", "Invalid JWT Signature.")
        try:
            claims = jwt.decode(
                assertion,
                account.public_key,
                algorithms=["RS256"],
                audience=[GOOGLE_TOKEN_URI, self.token_uri],
                options={"require": ["iss", "aud", "iat", "exp"]},
                leeway=60,
            )
        except jwt.InvalidSignatureError:
            return _oauth_error("invalid_grant", "Invalid JWT Signature.")
        except jwt.PyJWTError as exc:
            return _oauth_error("invalid_grant", f"Invalid JWT: {exc}")
        if int(claims["exp"]) - int(claims["iat"]) > 3600:
            return _oauth_error("invalid_grant", "Invalid JWT: exp too far in the future.")
        scope = str(claims.get("scope", ""))
        if not SEND_SCOPES & set(scope.split()):
            return _oauth_error("invalid_scope", "No valid scope for FCM.")
        access_token = "ya29.fake-" + secrets.token_urlsafe(32)
        now = time.time()
        with self._cond:
            self._access_tokens[access_token] = _AccessToken(
                claims["iss"], account.project_id, now + self.token_lifetime
            )
            self._grants.append(TokenGrant(claims["iss"], scope, now))
        body_out = {
            "access_token": access_token,
            "expires_in": self.token_lifetime,
            "token_type": "Bearer",
        }
        return _Reply(200, body_out, {"Cache-Control": "no-store"})

    def _handle_send(self, project: str, headers: dict[str, str], body: bytes) -> _Reply:
        now = time.time()
        authorization = headers.get("authorization", "")
        bearer = authorization[7:] if authorization.startswith("Bearer ") else ""
        try:
            payload: Any = json.loads(body)
        except ValueError:
            payload = None
        message = payload.get("message") if isinstance(payload, dict) else None
        message = message if isinstance(message, dict) else {}
        token = message.get("token")
        with self._cond:
            access = self._access_tokens.get(bearer)
            if access is None or access.expires_at < now:
                reply = _Reply(401, fcm_error_body(401), {"WWW-Authenticate": "Bearer"})
            elif access.project_id != project:
                text = (
                    "Permission 'cloudmessaging.messages.create' denied on resource "
                    f"'//cloudresourcemanager.googleapis.com/projects/{project}' "
                    "(or it may not exist)."
                )
                reply = _Reply(403, fcm_error_body(403, message=text))
            elif (problem := _invalid_message(payload)) is not None:
                reply = _Reply(400, fcm_error_body(400, "", problem[1], problem[0]))
            else:
                reply = self._scripted(token) or self._success(project, payload)
                if reply.status < 300 and not reply.body:
                    # A scripted (slow) success still names the message, as FCM does.
                    success = self._success(project, payload)
                    reply = _Reply(success.status, success.body, reply.headers, reply.delay)
            self._send_count += 1
            self._statuses[reply.status] += 1
            if self.record:
                self._sends.append(
                    RecordedSend(
                        project=project,
                        message=message,
                        headers=dict(headers),
                        time=now,
                        status=reply.status,
                        body=payload if isinstance(payload, dict) else {},
                    )
                )
            self._cond.notify_all()
        return reply

    def _scripted(self, token: Any) -> _Reply | None:
        for key in (token, None):
            scripts = self._scripts.get(key) if isinstance(key, str) or key is None else None
            if not scripts:
                continue
            script = scripts[0]
            if script.times is not None:
                script.times -= 1
                if script.times <= 0:
                    scripts.pop(0)
            if script.status < 300:
                # A scripted success (e.g. a slow one) still answers with a message name.
                return None if not script.delay else _Reply(200, {}, {}, script.delay)
            return _Reply(script.status, script.body, script.headers, script.delay)
        return None

    def _success(self, project: str, payload: dict[str, Any]) -> _Reply:
        if payload.get("validate_only"):
            return _Reply(200, {"name": f"projects/{project}/messages/fake_message_id"})
        self._message_ids += 1
        return _Reply(200, {"name": f"projects/{project}/messages/0:{self._message_ids}"})

    def _handle_control(self, path: str, body: bytes) -> _Reply:
        try:
            args = json.loads(body) if body else {}
        except ValueError:
            return _Reply(400, {"error": "body must be JSON"})
        if path == "/_fake/respond":
            self.respond(args.pop("token", None), **args)
        elif path == "/_fake/reset":
            self.reset()
        elif path == "/_fake/service-account":
            return _Reply(200, self.service_account(args.get("project_id", "test-project")))
        else:
            return _Reply(404, {"error": "unknown control path"})
        return _Reply(200, self.stats())


def _oauth_error(error: str, description: str) -> _Reply:
    return _Reply(400, {"error": error, "error_description": description})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--project", default="test-project")
    parser.add_argument("--write-service-account", metavar="PATH")
    parser.add_argument("--record", action="store_true", help="keep every request in memory")
    args = parser.parse_args(argv)

    fake = FakeFcm(args.host, args.port, record=args.record).start()
    info: dict[str, Any] = {"url": fake.url, "token_uri": fake.token_uri}
    if args.write_service_account:
        path = write_service_account(fake.service_account(args.project), args.write_service_account)
        info["service_account"] = str(path)
    announce_and_serve(info)
    fake.stop()
    print(json.dumps(fake.stats()), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
