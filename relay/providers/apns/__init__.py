"""APNs over HTTP/2 through aioapns 4.0, behind the synchronous `PushProvider` interface.

aioapns binds to the first event loop it runs on, and Celery calls us synchronously from
prefork processes or threads. So `send()` submits coroutines to the process's one provider
loop (`relay.providers.base.shared_loop`, a daemon thread shared with FCM's sends), and
`send_many()` a batch's requests side by side, in one hop to the loop and back. After a
fork the child starts its own loop on first use; a provider built before the fork rebuilds
its client there.

The client is built through aioapns' documented constructor; a custom CA (e.g. a test fake's) is
trusted through its `ssl_context`. Where it connects (aioapns has no host argument) and how a
request is sent on a connection is `relay.providers.apns.connection`, the one module that uses
aioapns' undocumented parts; sandbox, production and a local fake are one code path.

Privacy: the device token is the device's address. It is never logged nor returned.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar
from urllib.parse import urlsplit

from aioapns import APNs, NotificationRequest, PushType
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from relay.providers.apns import connection as apns_connection
from relay.providers.apns.connection import NotificationResult
from relay.providers.base import (
    BATCH_REQUESTS_IN_FLIGHT,
    DEFAULT_TIMEOUT_SECONDS,
    LoopThread,
    Outcome,
    SendResult,
    Wakeup,
    shared_loop,
)
from relay.providers.payloads import ApnsPayload

log = logging.getLogger(__name__)

PRODUCTION_HOST = "api.push.apple.com"
SANDBOX_HOST = "api.sandbox.push.apple.com"
DEFAULT_PORT = 443
DEFAULT_PAYLOAD = ApnsPayload()

_PEM_BLOCK = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----.+?-----END \1-----", re.DOTALL)
_HEX_TOKEN = re.compile(r"[0-9A-Fa-f]{16,200}")
_PUSH_ID_NAMESPACE = uuid.UUID("5b1f3a0e-3c7e-4f57-9d36-0c1a8f0e2b6d")

# Reasons that mean this token will never work again for this app.
_DEAD_400_REASONS = frozenset({"BadDeviceToken", "DeviceTokenNotForTopic"})


# --- credential validation (the admin, load_tenants and `ApnsConfig.validate` share it) ------


def pem_blocks(text: str, kind: str) -> list[str]:
    """PEM blocks whose label ends with `kind` ("CERTIFICATE", "PRIVATE KEY")."""
    return [m.group(0) for m in _PEM_BLOCK.finditer(text) if m.group(1).endswith(kind)]


def load_private_key(pem: str, what: str) -> Any:
    try:
        return serialization.load_pem_private_key(pem.strip().encode(), password=None)
    except TypeError:  # cryptography: "password was not given"
        raise ValueError(f"{what} is encrypted; give it without a passphrase") from None
    except (ValueError, UnsupportedAlgorithm):
        raise ValueError(f"{what} is not a PEM private key") from None


def describe_key(key: Any) -> str:
    """What kind of key this is, in words an operator recognises (never the key)."""
    if isinstance(key, ec.EllipticCurvePrivateKey):
        curve = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
        return f"an EC {curve.get(key.curve.name, key.curve.name)} key ({key.curve.name})"
    if isinstance(key, rsa.RSAPrivateKey):
        return f"an RSA {key.key_size}-bit key"
    return f"a {type(key).__name__.removeprefix('_')}"


def _spki(public_key: Any) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def first_certificate(pem: str) -> x509.Certificate:
    blocks = pem_blocks(pem, "CERTIFICATE")
    if not blocks:
        raise ValueError("The APNs certificate is not a PEM certificate")
    try:
        return x509.load_pem_x509_certificate(blocks[0].encode())
    except ValueError:
        raise ValueError("The APNs certificate cannot be parsed") from None


def validate_apns_key(pem: str) -> None:
    """A .p8 token-auth key: an unencrypted EC P-256 private key."""
    key = load_private_key(pem, "The APNs key")
    if not (isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"):
        raise ValueError(f"The APNs key must be an EC P-256 (.p8) key, not {describe_key(key)}")


def validate_apns_certificate(certificate: str) -> datetime:
    """Certificate auth: parses and is valid now; returns its not-after (UTC)."""
    cert = first_certificate(certificate)
    now = datetime.now(UTC)
    if cert.not_valid_after_utc <= now:
        raise ValueError(
            f"The APNs certificate expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        )
    if cert.not_valid_before_utc > now:
        raise ValueError(
            f"The APNs certificate is not valid before {cert.not_valid_before_utc:%Y-%m-%d} UTC"
        )
    return cert.not_valid_after_utc


def certificate_private_key(certificate: str, private_key: str) -> Any:
    """The certificate's key: from `private_key`, or from the certificate's PEM text."""
    blocks = pem_blocks(private_key or certificate, "PRIVATE KEY")
    if not blocks:
        raise ValueError("Certificate auth needs the certificate's private key (PEM)")
    return load_private_key(blocks[0], "The certificate's private key")


def validate_apns_certificate_key(certificate: str, private_key: str) -> None:
    key = certificate_private_key(certificate, private_key)
    if _spki(first_certificate(certificate).public_key()) != _spki(key.public_key()):
        raise ValueError("The private key does not belong to the APNs certificate")


def validate_ca_certificates(pem: str) -> None:
    if not pem_blocks(pem, "CERTIFICATE"):
        raise ValueError("The trust store must hold PEM certificates")
    try:
        x509.load_pem_x509_certificates(pem.encode())
    except ValueError:
        raise ValueError("The trust store holds a certificate that cannot be parsed") from None


@dataclass(frozen=True)
class ApnsConfig:
    """One app's APNs credentials: token auth (.p8 key) or certificate auth, never both.

    `certificate` may hold the certificate and its key in one PEM text (then leave
    `private_key` empty). `endpoint` is "host[:port]" or "https://host[:port]"; empty means
    Apple's host for `sandbox`. `ca_file` replaces the system trust store for that endpoint.
    """

    topic: str
    sandbox: bool = False
    key: str = field(default="", repr=False)
    key_id: str = ""
    team_id: str = ""
    certificate: str = field(default="", repr=False)
    private_key: str = field(default="", repr=False)
    endpoint: str = ""
    ca_file: str = ""
    alert_title: str = "New message"

    @property
    def uses_token_auth(self) -> bool:
        return bool(self.key.strip())

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) to connect to; Apple's by default."""
        if not self.endpoint.strip():
            return (SANDBOX_HOST if self.sandbox else PRODUCTION_HOST), DEFAULT_PORT
        text = self.endpoint.strip()
        parts = urlsplit(text if "//" in text else f"//{text}")
        if parts.scheme not in ("", "https") or parts.path not in ("", "/"):
            raise ValueError(f"APNs endpoint must be host[:port] or https://host[:port]: {text!r}")
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError as error:
            raise ValueError(f"APNs endpoint has a bad port: {text!r}") from error
        if not parts.hostname:
            raise ValueError(f"APNs endpoint has no host: {text!r}")
        return parts.hostname, port

    def _certificate(self) -> x509.Certificate:
        return first_certificate(self.certificate)

    def _certificate_key(self) -> Any:
        return certificate_private_key(self.certificate, self.private_key)

    @property
    def certificate_not_after(self) -> datetime | None:
        """When the certificate expires (UTC), for expiry warnings; None for token auth."""
        if self.uses_token_auth or not self.certificate.strip():
            return None
        return self._certificate().not_valid_after_utc

    def validate(self) -> None:
        """Raise ValueError with a message an operator can act on."""
        if not self.topic.strip():
            raise ValueError("APNs topic (the app's bundle id) is required")
        has_key, has_cert = self.uses_token_auth, bool(self.certificate.strip())
        if has_key == has_cert:
            raise ValueError(
                "APNs needs exactly one auth kind: a .p8 key (with key id and team id) "
                "or a certificate with its private key"
            )
        self.address  # noqa: B018 -- raises on a malformed endpoint
        if self.ca_file and not os.path.isfile(self.ca_file):
            raise ValueError(f"APNs CA file does not exist: {self.ca_file}")
        if has_key:
            self._validate_token_auth()
        else:
            self._validate_certificate_auth()

    def _validate_token_auth(self) -> None:
        if not self.key_id.strip() or not self.team_id.strip():
            raise ValueError("APNs token auth needs the key id and the team id")
        validate_apns_key(self.key)

    def _validate_certificate_auth(self) -> None:
        validate_apns_certificate(self.certificate)
        validate_apns_certificate_key(self.certificate, self.private_key)

    def client_pem(self) -> str:
        """Certificate chain plus an unencrypted PKCS#8 key, as `ssl.load_cert_chain` wants."""
        chain = pem_blocks(self.certificate, "CERTIFICATE")
        key = self._certificate_key().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return "\n".join(chain) + "\n" + key.decode()


def classify(status: int, reason: str) -> SendResult:
    """Map APNs' answer to an outcome; `reason` is Apple's code, e.g. "Unregistered"."""
    code = reason or str(status)
    if status == 200:
        return SendResult.delivered()
    if status == 410 or (status == 400 and reason in _DEAD_400_REASONS):
        return SendResult(Outcome.DEAD_TOKEN, code)
    if status == 429 or status >= 500:
        return SendResult(Outcome.RETRY_LATER, code)
    return SendResult(Outcome.FAILED, code)


def build_payload(
    wakeup: Wakeup, alert_title: str = "New message", options: ApnsPayload | None = None
) -> dict[str, Any]:
    """§1.4: a generic alert for important pushes, else a silent background wake-up; the
    app's payload options may rename the hash keys, add the push id or change the alert."""
    options = options or DEFAULT_PAYLOAD
    aps: dict[str, Any]
    if wakeup.important:
        alert = {"title": options.alert_title or alert_title}
        if options.alert_body:
            alert["body"] = options.alert_body
        aps = {"alert": alert}
        if options.sound:
            aps["sound"] = options.sound
        if options.mutable_content:
            aps["mutable-content"] = 1
    else:
        aps = {"content-available": 1}
    payload: dict[str, Any] = {"aps": aps, options.account_key: wakeup.account}
    if wakeup.channel:
        payload[options.channel_key] = wakeup.channel
    if options.push_id_key:
        payload[options.push_id_key] = wakeup.push_id
    return payload


def apns_id(push_id: str) -> str:
    """APNs wants a canonical UUID; derive a stable one if the push id is not one."""
    try:
        return str(uuid.UUID(push_id))
    except ValueError:
        return str(uuid.uuid5(_PUSH_ID_NAMESPACE, push_id))


class ApnsProvider:
    """Sends wake-ups for one app; thread-safe, one HTTP/2 connection reused for many sends."""

    service: ClassVar[str] = "apns"

    def __init__(
        self,
        config: ApnsConfig,
        *,
        timeout: float | None = None,
        time_to_live: int | None = None,
        payload: ApnsPayload | None = None,
    ) -> None:
        """`timeout` defaults to DEFAULT_TIMEOUT_SECONDS; `time_to_live` (seconds)
        sets apns-expiration so Apple drops a wake-up that could not reach the phone in time."""
        config.validate()
        if timeout is None:
            timeout = DEFAULT_TIMEOUT_SECONDS
        self.config = config
        self.payload = payload or DEFAULT_PAYLOAD
        self.timeout = timeout
        self.time_to_live = time_to_live
        self._lock = threading.Lock()
        self._client: APNs | None = None
        self._runner: LoopThread | None = None
        self._in_flight_slots: asyncio.Semaphore | None = None  # the loop's, with the client
        self._in_flight: set[str] = set()  # apns-ids being sent; touched on the loop only

    def __repr__(self) -> str:
        return f"<ApnsProvider topic={self.config.topic} address={self.config.address}>"

    # sync API

    def send(self, wakeup: Wakeup) -> SendResult:
        return self.send_many([wakeup])[0]

    def send_many(self, wakeups: list[Wakeup]) -> list[SendResult]:
        """The wake-ups' requests side by side on the provider loop; one result per wake-up."""
        results: list[SendResult | None] = [None] * len(wakeups)
        requests: dict[int, NotificationRequest] = {}
        for index, wakeup in enumerate(wakeups):
            if _HEX_TOKEN.fullmatch(wakeup.token):
                requests[index] = self._request(wakeup)
            else:
                # Apple would say the same; and the token must not reach the :path unchecked.
                results[index] = SendResult(Outcome.DEAD_TOKEN, "BadDeviceToken")
        if requests:
            sent = self._send_all(list(requests.values()))
            for index, answer in zip(requests, sent, strict=True):
                results[index] = answer
        answered = [result for result in results if result is not None]
        for wakeup, result in zip(wakeups, answered, strict=True):
            if result.outcome != Outcome.DELIVERED:
                log.info("APNs push %s: %s %s", wakeup.push_id, result.outcome, result.error_code)
        return answered

    def close(self) -> None:
        """Close this provider's connections; the shared loop keeps serving other providers."""
        with self._lock:
            client, runner = self._client, self._runner
            self._client = self._runner = None
        if client is not None and runner is not None and runner.usable:
            try:
                runner.submit(apns_connection.close(client)).result(5.0)
            except Exception as error:  # closing must not fail a credentials change
                log.warning("APNs client close failed: %s", type(error).__name__)

    # internals

    def _send_all(self, requests: list[NotificationRequest]) -> list[SendResult]:
        try:
            runner, client = self._client_here()
        except Exception as error:
            log.error("APNs client for %s cannot be built: %s", self.config.topic, error)
            return [SendResult(Outcome.FAILED, "CLIENT")] * len(requests)
        return runner.send_batch(self._gather(client, requests), len(requests), self.timeout + 5.0)

    async def _gather(self, client: APNs, requests: list[NotificationRequest]) -> list[SendResult]:
        return list(await asyncio.gather(*(self._send(client, r) for r in requests)))

    def _client_here(self) -> tuple[LoopThread, APNs]:
        """This process's loop and a client built in it (rebuilt after a fork or close)."""
        with self._lock:
            runner = shared_loop()
            if self._client is None or self._runner is not runner:
                self._client = runner.submit(self._make_client()).result(self.timeout)
                self._runner = runner
                self._in_flight_slots = None
            return runner, self._client

    async def _make_client(self) -> APNs:
        """Runs in the loop: aioapns grabs the current loop when constructed."""
        config = self.config
        context = ssl.create_default_context(cafile=config.ca_file or None)
        context.set_alpn_protocols(["h2"])
        common: dict[str, Any] = {"topic": config.topic, "ssl_context": context}
        if config.uses_token_auth:
            client = APNs(key=config.key, key_id=config.key_id, team_id=config.team_id, **common)
        else:
            # aioapns reads the chain from a file path; the file lives only while it loads.
            with tempfile.NamedTemporaryFile("w", suffix=".pem") as pem:
                pem.write(config.client_pem())
                pem.flush()
                client = APNs(client_cert=pem.name, **common)
        apns_connection.point_at(client, *config.address)
        return client

    def _request(self, wakeup: Wakeup) -> NotificationRequest:
        hash_ = wakeup.channel or wakeup.account
        return NotificationRequest(
            device_token=wakeup.token,
            message=build_payload(wakeup, self.config.alert_title, self.payload),
            notification_id=apns_id(wakeup.push_id),
            time_to_live=self.time_to_live,
            priority=10 if wakeup.important else 5,
            collapse_key=hash_[:6] or None,
            push_type=PushType.ALERT if wakeup.important else PushType.BACKGROUND,
        )

    async def _send(self, client: APNs, request: NotificationRequest) -> SendResult:
        """Send, never raising: what could not be answered within the timeout (a wait for one
        of the provider's slots included) is RETRY_LATER."""
        if self._in_flight_slots is None:  # on the loop, which it binds to
            self._in_flight_slots = asyncio.Semaphore(BATCH_REQUESTS_IN_FLIGHT)
        slots = self._in_flight_slots
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        if slots.locked():
            try:
                await asyncio.wait_for(slots.acquire(), self.timeout)
            except TimeoutError:
                return SendResult(Outcome.RETRY_LATER, "TIMEOUT")
        else:
            await slots.acquire()  # at once, without wait_for's task
        try:
            return await self._send_in_slot(client, request, max(deadline - loop.time(), 0.001))
        finally:
            slots.release()

    async def _send_in_slot(
        self, client: APNs, request: NotificationRequest, timeout: float
    ) -> SendResult:
        if request.notification_id in self._in_flight:
            # aioapns keys answers by apns-id: two live requests with one id would hang one.
            request.notification_id = str(uuid.uuid4())
        self._in_flight.add(request.notification_id)
        try:
            response = await apns_connection.send(client, request, timeout)
        except TimeoutError:
            return SendResult(Outcome.RETRY_LATER, "TIMEOUT")
        except Exception as error:
            log.warning("APNs send failed: %s", type(error).__name__)
            return SendResult(Outcome.RETRY_LATER, "NETWORK")
        finally:
            self._in_flight.discard(request.notification_id)
        return _classify_response(response)


def _classify_response(response: NotificationResult) -> SendResult:
    try:
        status = int(response.status)
    except ValueError:
        return SendResult(Outcome.RETRY_LATER, "NETWORK")
    return classify(status, response.description or "")


__all__ = [
    "PRODUCTION_HOST",
    "SANDBOX_HOST",
    "ApnsConfig",
    "ApnsProvider",
    "apns_id",
    "build_payload",
    "classify",
]
