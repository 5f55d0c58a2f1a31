"""Web Push (RFC 8030) with message encryption (RFC 8291, `aes128gcm`) and VAPID (RFC 8292):
a browser's push service, or a UnifiedPush distributor (ntfy, NextPush, ...), wakes the client.

The subscription (the registration's token) is what the client's PushManager gave it: the
endpoint URL and its `p256dh` and `auth` keys. The wake-up is a small JSON object, encrypted to
those keys by pywebpush (`WebPusher.encode`, with http-ece underneath), so the push service
sees nothing but its size; the JWT of the `Authorization: vapid t=…,k=…` header is signed by
py-vapid with the app's key, one per push service origin, reused until shortly before it
expires. No cryptography is written here.

A lone wake-up (`send`) is POSTed over requests in the caller's thread; a batch's
(`send_many`) side by side over aiohttp on the process's provider loop
(`relay.providers.base.shared_loop`), encrypted first in the caller's thread. Neither follows
a redirect: the endpoint is what the allow-list checked.

Classification (`classify`):

=================================  ===========  ===================
The push service's answer          Outcome      error_code
=================================  ===========  ===================
2xx (201 Created)                  DELIVERED    ""
404, 410                           DEAD_TOKEN   HTTP_404 / HTTP_410
408, 429, 5xx (+ Retry-After)      RETRY_LATER  HTTP_<code>
400, 401, 403, 413, other 4xx      FAILED       HTTP_<code>
3xx (a redirect, not followed)     FAILED       HTTP_<code>
timeout / network error            RETRY_LATER  TIMEOUT / NETWORK
endpoint not on the allowed hosts  FAILED       ENDPOINT_NOT_ALLOWED
a subscription that does not load  DEAD_TOKEN   BAD_SUBSCRIPTION
=================================  ===========  ===================
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import hashlib
import ipaddress
import json
import logging
import re
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar
from urllib.parse import urlsplit

import aiohttp
import requests
from cryptography.hazmat.primitives.asymmetric import ec
from py_vapid import Vapid02
from pywebpush import WebPusher, WebPushException
from requests.adapters import HTTPAdapter

from relay.providers.base import (
    DEFAULT_TIMEOUT_SECONDS,
    LoopSession,
    Outcome,
    ProviderClosed,
    SendResult,
    Wakeup,
    parse_retry_after,
)
from relay.providers.wns import channel_uri_allowed, parse_host_pattern

logger = logging.getLogger(__name__)

# How long a push service keeps an undelivered wake-up when the app sets no TTL (seconds).
DEFAULT_TTL = 86400
MAX_TTL = 28 * 86400
# The longest endpoint URL accepted (browsers' are a few hundred characters).
MAX_ENDPOINT_LENGTH = 2048
# A VAPID JWT is valid for at most 24 hours (RFC 8292 2); ours for 12, renewed an hour early.
JWT_LIFETIME = 12 * 3600
JWT_RENEW_BEFORE = 3600
# Connections kept per push service origin: a worker's threads share them.
POOL_CONNECTIONS = 100
_TRANSIENT = frozenset({408, 429})
_SUBJECT = re.compile(r"(mailto:[^@\s]+@[^@\s]+|https://[^\s/]+(/\S*)?)", re.IGNORECASE)


def _unpadded_b64decode(value: str) -> bytes:
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))


def _b64encode(value: bytes) -> str:
    return base64.urlsafe_b64encode(value).rstrip(b"=").decode()


@dataclass(frozen=True, slots=True)
class Subscription:
    """A client's push subscription: where to POST and the keys to encrypt to."""

    endpoint: str
    p256dh: str = field(repr=False)
    auth: str = field(repr=False)

    @property
    def info(self) -> dict[str, Any]:
        """The shape of the browser's PushSubscription.toJSON(), as pywebpush takes it."""
        return {"endpoint": self.endpoint, "keys": {"p256dh": self.p256dh, "auth": self.auth}}

    def token(self) -> str:
        """The registration's token: the subscription as compact JSON."""
        return json.dumps(self.info, separators=(",", ":"), sort_keys=True)


def subscription(endpoint: str, p256dh: str, auth: str) -> Subscription:
    """A subscription from the registration's fields; ValueError saying what is wrong
    (never echoing a key or the endpoint, which is the device's capability)."""
    endpoint, p256dh, auth = endpoint.strip(), p256dh.strip(), auth.strip()
    if not endpoint:
        raise ValueError("endpoint is required")
    if len(endpoint) > MAX_ENDPOINT_LENGTH:
        raise ValueError(f"endpoint must be a URL of at most {MAX_ENDPOINT_LENGTH} characters")
    try:
        point = _unpadded_b64decode(p256dh)
        ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
    except (binascii.Error, ValueError):
        raise ValueError("p256dh must be the subscription's P-256 key, base64url") from None
    if len(point) != 65:
        raise ValueError("p256dh must be an uncompressed P-256 point (65 bytes), base64url")
    try:
        secret = _unpadded_b64decode(auth)
    except (binascii.Error, ValueError):
        raise ValueError("auth must be the subscription's auth secret, base64url") from None
    if len(secret) != 16:
        raise ValueError("auth must be the subscription's 16-byte auth secret, base64url")
    return Subscription(endpoint, p256dh, auth)


def parse_token(token: str) -> Subscription:
    """The subscription a registration's token holds; ValueError if it holds none."""
    try:
        info = json.loads(token)
        keys = info["keys"]
        return subscription(str(info["endpoint"]), str(keys["p256dh"]), str(keys["auth"]))
    except (TypeError, KeyError, ValueError) as error:
        raise ValueError(f"not a Web Push subscription: {error}") from None


def endpoint_allowed(endpoint: str, hosts: Sequence[str]) -> bool:
    """Whether the worker may POST to `endpoint`: on the app's host patterns (the WNS
    channel host syntax, docs/operators.md), or with none, any public https host (a DNS name
    or a global IP address, no userinfo, no fragment)."""
    if hosts:
        return channel_uri_allowed(endpoint, hosts)
    try:
        parts = urlsplit(endpoint)
        host, _ = parts.hostname, parts.port
    except ValueError:
        return False
    if parts.scheme != "https" or not host or "@" in parts.netloc or parts.fragment:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return "." in host and host != "localhost" and not host.endswith(".localhost")
    return address.is_global


def why_not_allowed(endpoint: str, hosts: Sequence[str]) -> str:
    prefix = "the Web Push endpoint cannot be sent to: "
    if hosts:
        return f"{prefix}its host or port is not one this app allows ({', '.join(hosts)})."
    return f"{prefix}it must be an https URL on a public host."


def validate_private_key(pem: str) -> None:
    """Raise ValueError unless `pem` is an EC P-256 private key (what VAPID signs with)."""
    try:
        key = Vapid02.from_pem(pem.strip().encode()).private_key
    except Exception:  # py-vapid raises what the decoders raise
        raise ValueError("The VAPID private key is not a PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise ValueError("The VAPID private key must be an EC P-256 key")


def public_key(pem: str) -> str:
    """The VAPID public key, base64url: the applicationServerKey clients subscribe with."""
    from cryptography.hazmat.primitives import serialization

    key = Vapid02.from_pem(pem.strip().encode()).public_key
    raw = key.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    return _b64encode(raw)


def new_private_key() -> str:
    """A new VAPID key pair's private key, PEM (PKCS#8)."""
    vapid = Vapid02()
    vapid.generate_keys()
    return str(vapid.private_pem().decode())


@dataclass(frozen=True)
class WebPushConfig:
    """One app's VAPID key and how its wake-ups are sent."""

    private_key: str = field(repr=False)
    subject: str
    endpoint_hosts: tuple[str, ...] = ()
    ttl: int = DEFAULT_TTL
    topic: bool = False

    def validate(self) -> None:
        validate_private_key(self.private_key)
        if not _SUBJECT.fullmatch(self.subject or ""):
            raise ValueError("The VAPID contact must be a mailto: address or an https URL")
        if not 0 <= self.ttl <= MAX_TTL:
            raise ValueError(f"The TTL must be 0 to {MAX_TTL} seconds")
        for pattern in self.endpoint_hosts:
            parse_host_pattern(pattern)


def build_payload(wakeup: Wakeup) -> bytes:
    """What the client decrypts (docs/protocols.md): the account hash and the priority, the
    room hash for a room. Never a JID or a body."""
    payload = {"account": wakeup.account, "priority": "high" if wakeup.important else "normal"}
    if wakeup.channel:
        payload["channel"] = wakeup.channel
    return json.dumps(payload, separators=(",", ":")).encode()


def topic(wakeup: Wakeup) -> str:
    """A Topic (RFC 8030 5.4: at most 32 base64url characters) per account and room, so the
    push service keeps only the newest waiting wake-up of each."""
    digest = hashlib.sha256(f"{wakeup.account}\0{wakeup.channel}".encode()).digest()
    return _b64encode(digest)[:32]


def classify(status: int, retry_after: str | None = None) -> SendResult:
    if 200 <= status < 300:
        return SendResult.delivered()
    code = f"HTTP_{status}"
    if status in (404, 410):
        return SendResult(Outcome.DEAD_TOKEN, code)
    if status in _TRANSIENT or status >= 500:
        return SendResult(Outcome.RETRY_LATER, code, parse_retry_after(retry_after))
    return SendResult(Outcome.FAILED, code)


@dataclass(frozen=True, slots=True)
class _Request:
    """A wake-up ready to POST: encrypted, its headers signed."""

    push_id: str
    endpoint: str
    headers: dict[str, str]
    body: bytes


def _origin(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    return f"{parts.scheme}://{parts.netloc}"


@lru_cache(maxsize=8)
def _tls(bundle: str) -> ssl.SSLContext:
    """One verifying context per CA bundle for every app's batches: loading it is slow."""
    return ssl.create_default_context(cafile=bundle)


class WebPushProvider:
    """Sends encrypted wake-ups for one app; safe to share between threads."""

    service: ClassVar[str] = "webpush"

    def __init__(
        self, config: WebPushConfig, *, timeout: float | None = None, ca_bundle: str = ""
    ) -> None:
        config.validate()
        self.config = config
        self.timeout = DEFAULT_TIMEOUT_SECONDS if timeout is None else float(timeout)
        self._vapid = Vapid02.from_pem(config.private_key.strip().encode())
        self._tokens: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        # Kept-alive connections per push service, no retries (the relay's queue retries
        # with its own backoff), nothing from the environment (proxies, .netrc).
        self._session = requests.Session()
        self._session.trust_env = False
        adapter = HTTPAdapter(
            pool_connections=POOL_CONNECTIONS, pool_maxsize=POOL_CONNECTIONS, max_retries=0
        )
        self._session.mount("https://", adapter)
        self._session.mount("http://", adapter)
        # Both ways trust the same authorities: the operator's bundle (REQUESTS_CA_BUNDLE),
        # else certifi's, as requests does (aiohttp's own default is the system's store).
        bundle = ca_bundle or requests.certs.where()
        self._session.verify = bundle
        self._loop_session = LoopSession(
            timeout=aiohttp.ClientTimeout(sock_connect=self.timeout, sock_read=self.timeout),
            build_timeout=self.timeout,
            tls=lambda: _tls(bundle),
        )
        # What a batch may take at most, every request waiting for a connection, connecting
        # and reading at its timeout: only a wedged loop reaches it.
        self._batch_seconds = 3 * self.timeout + 5.0

    def __repr__(self) -> str:
        return f"<WebPushProvider subject={self.config.subject}>"

    def _authorization(self, endpoint: str) -> str:
        """`vapid t=<JWT>,k=<public key>` for the endpoint's origin (the JWT's audience)."""
        origin = _origin(endpoint)
        now = time.time()
        with self._lock:
            kept = self._tokens.get(origin)
            if kept is not None and kept[1] - now > JWT_RENEW_BEFORE:
                return kept[0]
            expires = int(now) + JWT_LIFETIME
            claims = {"aud": origin, "exp": expires, "sub": self.config.subject}
            header = str(self._vapid.sign(claims)["Authorization"])
            self._tokens[origin] = (header, expires)
            return header

    def send(self, wakeup: Wakeup) -> SendResult:
        request = self._prepare(wakeup)
        if isinstance(request, SendResult):
            return request
        try:
            response = self._session.post(
                request.endpoint,
                data=request.body,
                headers=request.headers,
                timeout=self.timeout,
                allow_redirects=False,
            )
        except requests.Timeout:
            return SendResult(Outcome.RETRY_LATER, "TIMEOUT")
        except requests.RequestException:
            return SendResult(Outcome.RETRY_LATER, "NETWORK")
        response.close()
        return self._answered(request, response.status_code, response.headers.get("Retry-After"))

    def send_many(self, wakeups: list[Wakeup]) -> list[SendResult]:
        """The batch's requests side by side on the provider loop; one result per wake-up."""
        prepared = [self._prepare(wakeup) for wakeup in wakeups]
        ready = [request for request in prepared if isinstance(request, _Request)]
        if not ready:
            return [result for result in prepared if isinstance(result, SendResult)]
        try:
            runner, session = self._loop_session.here()
        except ProviderClosed:
            return [SendResult(Outcome.RETRY_LATER, "CLOSED")] * len(wakeups)
        except (OSError, concurrent.futures.TimeoutError) as error:
            logger.warning("webpush.client_not_built", extra={"error_type": type(error).__name__})
            return [SendResult(Outcome.RETRY_LATER, "NETWORK")] * len(wakeups)
        sent = iter(
            runner.send_batch(self._post_all(session, ready), len(ready), self._batch_seconds)
        )
        return [next(sent) if isinstance(item, _Request) else item for item in prepared]

    def _prepare(self, wakeup: Wakeup) -> _Request | SendResult:
        """The wake-up encrypted to its subscription with its headers, or why it is not sent."""
        if self._loop_session.closed:
            # The app's credentials changed under an in-flight task: the retry uses the new ones.
            return SendResult(Outcome.RETRY_LATER, "CLOSED")
        try:
            target = parse_token(wakeup.token)
        except ValueError:
            return SendResult(Outcome.DEAD_TOKEN, "BAD_SUBSCRIPTION")
        if not endpoint_allowed(target.endpoint, self.config.endpoint_hosts):
            logger.warning("webpush: endpoint not allowed, push %s not sent", wakeup.push_id)
            return SendResult(Outcome.FAILED, "ENDPOINT_NOT_ALLOWED")
        try:
            body = WebPusher(target.info).encode(build_payload(wakeup), "aes128gcm")["body"]
        except (WebPushException, ValueError):
            return SendResult(Outcome.DEAD_TOKEN, "BAD_SUBSCRIPTION")
        headers = {
            "Authorization": self._authorization(target.endpoint),
            "Content-Encoding": "aes128gcm",
            "TTL": str(self.config.ttl),
            "Urgency": "high" if wakeup.important else "normal",
        }
        if self.config.topic:
            headers["Topic"] = topic(wakeup)
        return _Request(wakeup.push_id, target.endpoint, headers, bytes(body))

    async def _post_all(
        self, session: aiohttp.ClientSession, ready: list[_Request]
    ) -> list[SendResult]:
        return list(await asyncio.gather(*(self._post(session, r) for r in ready)))

    async def _post(self, session: aiohttp.ClientSession, request: _Request) -> SendResult:
        try:
            async with session.post(
                request.endpoint,
                data=request.body,
                headers=request.headers,
                allow_redirects=False,
            ) as response:
                await response.read()
                status, retry_after = response.status, response.headers.get("Retry-After")
        except TimeoutError:  # aiohttp's connect and read timeouts are TimeoutErrors
            return SendResult(Outcome.RETRY_LATER, "TIMEOUT")
        except (aiohttp.ClientError, OSError, ValueError):  # refused, dropped, a bad URL
            return SendResult(Outcome.RETRY_LATER, "NETWORK")
        except Exception as error:  # one crash must not cost the batch its other results
            logger.exception("webpush.send_crashed", extra={"error_type": type(error).__name__})
            return SendResult(Outcome.RETRY_LATER, "INTERNAL")
        return self._answered(request, status, retry_after)

    @staticmethod
    def _answered(request: _Request, status: int, retry_after: str | None) -> SendResult:
        result = classify(status, retry_after)
        if result.outcome is not Outcome.DELIVERED:
            logger.info(
                "webpush.not_delivered", extra={"push_id": request.push_id, "status": status}
            )
        return result

    def close(self) -> None:
        self._loop_session.close()
        self._session.close()
