"""Windows Push Notification Services: a raw wake-up per channel URI, on our own small client.

Why our own: the known libraries fetch a new OAuth token per send and follow redirects with the
bearer token attached. This client keeps one token per app (single-flight across threads),
refreshes it once on a 401, never follows redirects, and only ever sends to channel URIs whose
host is on the allow-list, so a registered "channel URI" cannot point our token somewhere else.
A lone wake-up goes over httpx in the caller's thread; a batch's (`send_many`) side by side over
aiohttp on the process's provider loop, the token still fetched in the caller's thread.

Classification of WNS's answer (see `_classify`):

====================================  =============  ==========================
WNS answer                            Outcome        error_code
====================================  =============  ==========================
200, X-WNS-Status received / absent   DELIVERED      ""
200, X-WNS-Status dropped             DELIVERED      DROPPED
200, X-WNS-Status channelthrottled    RETRY_LATER    THROTTLED
404, 410                              DEAD_TOKEN     HTTP_404 / HTTP_410
406, 429 (+ Retry-After)              RETRY_LATER    THROTTLED
401 twice (after one token refresh)   FAILED         HTTP_401
400, 403, 405, 413, other 4xx         FAILED         HTTP_<code>
5xx (+ Retry-After)                   RETRY_LATER    HTTP_<code>
timeout / network error               RETRY_LATER    TIMEOUT / NETWORK
channel host not on the allow-list    FAILED         CHANNEL_HOST_NOT_ALLOWED
token endpoint 4xx (invalid_client)   FAILED         AUTH
token endpoint 429 / 5xx              RETRY_LATER    AUTH_HTTP_<code>
token endpoint timeout / network      RETRY_LATER    AUTH_TIMEOUT / AUTH_NETWORK
token endpoint unusable 200 answer    RETRY_LATER    AUTH_BAD_RESPONSE
====================================  =============  ==========================

"dropped" means WNS accepted the push and decided not to pass it on (the client turned raw
notifications off, or the device is offline and nothing is cached): resending cannot change
that, so it counts as delivered to WNS. "channelthrottled" means this one was thrown away for
the channel's rate: like 406 it is temporary and a wake-up is harmless to repeat.

A channel URI whose host is not allowed is FAILED, not DEAD_TOKEN: registration validates with
the same `channel_uri_allowed`, so a stored URI failing it means the allow-list changed, and a
configuration mistake must not delete every Windows registration.

Priority (X-WNS-Priority 1 high .. 4 very low; WNS's default for raw is 3):
important -> 1 with X-WNS-Cache-Policy: cache (delivered at once, even in battery saver, and
one is kept for an offline device); silent -> 3 with no-cache (WNS's raw default: handled when
the device is in use, nothing kept, the next connection catches up anyway).

Never logged or returned: the channel URI (it is the device's address and a capability), the
client secret and the access token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import json
import logging
import re
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import ClassVar
from urllib.parse import urlsplit

import aiohttp
import httpx
import yarl

from relay.providers.base import (
    DEFAULT_TIMEOUT_SECONDS,
    LoopSession,
    Outcome,
    ProviderClosed,
    SendResult,
    Wakeup,
    parse_retry_after,
)
from relay.providers.payloads import WnsPayload

logger = logging.getLogger(__name__)

# httpx logs every request's full URL at INFO: for WNS that is the device's channel URI. Keep it
# quiet unless the operator configured the "httpx" logger on purpose.
if logging.getLogger("httpx").level == logging.NOTSET:
    logging.getLogger("httpx").setLevel(logging.WARNING)

DEFAULT_TOKEN_URL = "https://login.live.com/accesstoken.srf"
DEFAULT_PAYLOAD = WnsPayload()
DEFAULT_CHANNEL_HOSTS: tuple[str, ...] = ("*.notify.windows.com",)
TOKEN_SCOPE = "notify.windows.com"
# Used when the token answer has no usable expires_in (WNS documents 86400).
DEFAULT_TOKEN_LIFETIME = 86400.0
# Refresh this long before expiry (capped at a tenth of the lifetime for short-lived tokens).
TOKEN_EXPIRY_MARGIN = 300.0
# After a failed token fetch, answer the same failure for this long instead of queueing every
# worker thread behind another slow request to a failing endpoint.
AUTH_FAILURE_HOLD = 5.0

_DEFAULT_PORTS = {"https": 443, "http": 80}
_ANY_PORT = -1
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")
# Printable ASCII without space or backslash: anything else invites parser differences.
_URI_CHARS = re.compile(r"[\x21-\x5b\x5d-\x7e]+")


# --- Channel URI allow-list -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _HostPattern:
    host: str  # the exact host, or for "*.suffix" the suffix
    wildcard: bool
    port: int | None  # None: the scheme's default port; _ANY_PORT: any
    loopback: bool


def _is_dns_name(host: str) -> bool:
    return 0 < len(host) <= 253 and all(_LABEL.fullmatch(label) for label in host.split("."))


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _is_loopback(host: str) -> bool:
    ip = _ip(host)
    return host == "localhost" or (ip is not None and ip.is_loopback)


@lru_cache(maxsize=128)
def parse_host_pattern(pattern: str) -> _HostPattern:
    """Parse "*.example.com", "host", "host:443", "127.0.0.1:*" or "[::1]:*"; ValueError if bad."""
    text = pattern.strip().lower()
    port: int | None = None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"channel host pattern {pattern!r}: bad IPv6 literal")
        port_text = rest[1:] if rest else None
        if _ip(host) is None:
            raise ValueError(f"channel host pattern {pattern!r}: bad IPv6 literal")
    else:
        host, sep, port_text_ = text.rpartition(":")
        host, port_text = (host, port_text_) if sep else (text, None)
    if port_text is not None:
        if port_text == "*":
            port = _ANY_PORT
        elif port_text.isdigit() and 0 < int(port_text) < 65536:
            port = int(port_text)
        else:
            raise ValueError(f"channel host pattern {pattern!r}: port must be 1-65535 or *")
    wildcard = host.startswith("*.")
    if wildcard:
        host = host[2:]
        if not _is_dns_name(host) or host.count(".") < 1:
            raise ValueError(
                f"channel host pattern {pattern!r}: a wildcard needs a domain of at least two "
                "labels, like *.notify.windows.com"
            )
        return _HostPattern(host, True, port, loopback=False)
    ip = _ip(host)
    if ip is None and not _is_dns_name(host):
        raise ValueError(f"channel host pattern {pattern!r}: not a host name or IP address")
    return _HostPattern(host, False, port, _is_loopback(host))


def _pattern_allows(pattern: _HostPattern, scheme: str, host: str, port: int) -> bool:
    if scheme == "http" and not pattern.loopback:
        return False
    if pattern.wildcard:
        prefix = host[: -len(pattern.host) - 1] if host.endswith("." + pattern.host) else ""
        if not prefix or not _is_dns_name(prefix):
            return False
    elif pattern.host != host:
        return False
    if pattern.port == _ANY_PORT:
        return True
    return port == (pattern.port if pattern.port is not None else _DEFAULT_PORTS[scheme])


def channel_uri_allowed(uri: str, hosts: Sequence[str]) -> bool:
    """Whether we may POST a bearer token to `uri`: https on an allowed host, nothing clever.

    `hosts` holds patterns: "*.notify.windows.com" (subdomains only), exact hosts, optionally with
    ":port" or ":*". Plain http is accepted only for loopback patterns (test fakes). Userinfo,
    fragments, whitespace, non-ASCII and anything urllib, httpx and yarl (aiohttp's) would read
    differently are refused. Never raises; invalid patterns match nothing.
    """
    if not isinstance(uri, str) or not _URI_CHARS.fullmatch(uri) or "#" in uri:
        return False
    try:
        parts = urlsplit(uri)
        scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port
        url = httpx.URL(uri)
        batch_url = yarl.URL(uri)
    except (ValueError, TypeError, httpx.InvalidURL):
        return False
    if scheme not in _DEFAULT_PORTS or not host or "@" in parts.netloc:
        return False
    port = port if port is not None else _DEFAULT_PORTS[scheme]
    # Every parser must agree on where this goes: httpx connects for a lone send, aiohttp
    # (yarl) for a batch.
    if (
        url.scheme != scheme
        or url.raw_host.decode("ascii", "replace").lower() != host
        or (url.port if url.port is not None else _DEFAULT_PORTS[scheme]) != port
        or url.userinfo
        or batch_url.scheme != scheme
        or (batch_url.raw_host or "").lower() != host
        or batch_url.port != port
        or batch_url.raw_user is not None
        or batch_url.raw_password is not None
    ):
        return False
    for raw in hosts:
        try:
            pattern = parse_host_pattern(raw)
        except (ValueError, TypeError, AttributeError):  # not a valid pattern string
            continue
        if _pattern_allows(pattern, scheme, host, port):
            return True
    return False


# --- Configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WnsConfig:
    """One app's WNS credentials (from the Partner Center) and where we may send."""

    package_sid: str
    secret: str = field(repr=False)  # kept out of reprs, tracebacks and logs
    token_url: str = DEFAULT_TOKEN_URL
    channel_hosts: tuple[str, ...] = DEFAULT_CHANNEL_HOSTS

    def validate(self) -> None:
        """Fail loudly at start-up with a message an operator can act on."""
        if not isinstance(self.package_sid, str) or not self.package_sid.startswith("ms-app://"):
            raise ValueError("WNS package SID must look like ms-app://s-1-15-2-…")
        if self.package_sid != self.package_sid.strip() or len(self.package_sid) <= 9:
            raise ValueError("WNS package SID is empty or has surrounding whitespace")
        if not isinstance(self.secret, str) or not self.secret:
            raise ValueError("WNS client secret is empty")
        if self.secret != self.secret.strip():
            raise ValueError("WNS client secret has surrounding whitespace (a paste error?)")
        token = urlsplit(self.token_url) if isinstance(self.token_url, str) else None
        if (
            token is None
            or not token.hostname
            or "@" in token.netloc
            or token.fragment
            or not (
                token.scheme == "https" or (token.scheme == "http" and _is_loopback(token.hostname))
            )
        ):
            raise ValueError("WNS token URL must be an https URL (plain http only on loopback)")
        if isinstance(self.channel_hosts, str) or not self.channel_hosts:
            raise ValueError(
                "WNS channel hosts must be a non-empty list of patterns, "
                'like ("*.notify.windows.com",)'
            )
        for pattern in self.channel_hosts:
            if not isinstance(pattern, str):
                raise ValueError(f"WNS channel host pattern {pattern!r} is not a string")
            parse_host_pattern(pattern)


# --- The provider -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Token:
    value: str
    refresh_at: float


class _AuthError(Exception):
    """The token endpoint's answer, already classified."""

    def __init__(self, result: SendResult) -> None:
        super().__init__(result.error_code)
        self.result = result


@lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    """One verifying TLS context for every app's client: loading the CA bundle is slow."""
    return httpx.create_ssl_context(trust_env=False)


def _wns_status(headers: Mapping[str, str]) -> str:
    raw = headers.get("X-WNS-Status") or headers.get("X-WNS-NotificationStatus")
    return (raw or "").strip().lower()


def _classify(code: int, headers: Mapping[str, str]) -> SendResult:
    """Map one channel answer to an outcome (table in the module docstring)."""
    retry_after = parse_retry_after(headers.get("Retry-After"))
    if code == 200:
        status = _wns_status(headers)
        if status == "channelthrottled":
            return SendResult(Outcome.RETRY_LATER, "THROTTLED", retry_after)
        if status == "dropped":
            return SendResult(Outcome.DELIVERED, "DROPPED")
        return SendResult.delivered()
    if code in (404, 410):
        return SendResult(Outcome.DEAD_TOKEN, f"HTTP_{code}")
    if code in (406, 429):
        return SendResult(Outcome.RETRY_LATER, "THROTTLED", retry_after)
    if code >= 500:
        return SendResult(Outcome.RETRY_LATER, f"HTTP_{code}", retry_after)
    return SendResult(Outcome.FAILED, f"HTTP_{code}")


def _logged(
    wakeup: Wakeup,
    result: SendResult,
    status: int | None = None,
    headers: Mapping[str, str] | None = None,
) -> SendResult:
    logger.debug(
        "wns: push %s -> %s %s (HTTP %s, msg id %s)",
        wakeup.push_id,
        result.outcome,
        result.error_code or "-",
        status if status is not None else "-",
        headers.get("X-WNS-Msg-ID", "-") if headers is not None else "-",
    )
    return result


def _answered(wakeup: Wakeup, status: int, headers: Mapping[str, str]) -> SendResult:
    """The channel's answer classified (and logged without the channel URI)."""
    result = _classify(status, headers)
    if result.outcome == Outcome.FAILED:
        # WNS's own diagnostics; they describe the request, not the device.
        logger.warning(
            "wns: push %s failed with HTTP %s (%s)",
            wakeup.push_id,
            status,
            headers.get("X-WNS-Error-Description", "no description")[:120],
        )
    return _logged(wakeup, result, status, headers)


def _failed_request(wakeup: Wakeup, exc: Exception) -> SendResult:
    """A request that got no answer: why, as an outcome."""
    if isinstance(exc, httpx.TimeoutException):
        return _logged(wakeup, SendResult(Outcome.RETRY_LATER, "TIMEOUT"))
    if isinstance(exc, httpx.TransportError):
        logger.info("wns: push %s: %s", wakeup.push_id, type(exc).__name__)
        return _logged(wakeup, SendResult(Outcome.RETRY_LATER, "NETWORK"))
    if isinstance(exc, RuntimeError):
        # close() raced a send (credentials changed): the next attempt uses the new client.
        return _logged(wakeup, SendResult(Outcome.RETRY_LATER, "CLOSED"))
    logger.warning("wns: push %s not sent: %s", wakeup.push_id, type(exc).__name__)
    return SendResult(Outcome.FAILED, "CLIENT_ERROR")


# A batch's 401, to be sent again with a refreshed token (compared by identity).
_REFUSED = SendResult(Outcome.FAILED, "HTTP_401")


def _not_allowed(wakeup: Wakeup) -> SendResult:
    logger.warning("wns: channel host not allowed, push %s not sent", wakeup.push_id)
    return SendResult(Outcome.FAILED, "CHANNEL_HOST_NOT_ALLOWED")


def build_body(wakeup: Wakeup, payload: WnsPayload | None = None) -> dict[str, object]:
    """The raw notification of docs/protocols.md 3.3 (the app's payload options may rename the
    account key or add the push id)."""
    payload = payload or DEFAULT_PAYLOAD
    body: dict[str, object] = {
        "version": 2,
        "action": "push",
        payload.account_key: wakeup.account,
        "message_count": wakeup.message_count or 0,
        "pending_subscription_count": wakeup.pending_subscription_count or 0,
    }
    if payload.push_id_key:
        body[payload.push_id_key] = wakeup.push_id
    return body


class WnsProvider:
    """Sends raw WNS wake-ups for one app; safe to share between threads."""

    service: ClassVar[str] = "wns"

    def __init__(
        self,
        config: WnsConfig,
        *,
        timeout: float | None = None,
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.monotonic,
        payload: WnsPayload | None = None,
    ) -> None:
        config.validate()
        if timeout is None:
            timeout = DEFAULT_TIMEOUT_SECONDS
        self._config = config
        self._payload = payload or DEFAULT_PAYLOAD
        self._clock = clock
        self._owns_client = client is None
        # trust_env=False: no proxy or .netrc from the environment may touch our bearer token.
        self._client = client or httpx.Client(
            timeout=timeout, follow_redirects=False, trust_env=False, verify=_ssl_context()
        )
        # A batch's requests (`send_many`) go side by side over aiohttp on the process's
        # provider loop, not httpx's asynchronous client, whose pool polls every pooled
        # connection's socket on each request (docs/benchmarks.md, WNS batches on the loop);
        # `channel_uri_allowed` checks that aiohttp's URL parser (yarl) reads a channel URI
        # as the others do.
        self._loop_session = LoopSession(
            timeout=aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout),
            build_timeout=timeout,
            tls=_ssl_context,
        )
        # What one round of a batch may take at most (each request waiting for a connection,
        # then its own timeout; a 401's resend is a round of its own): only a wedged loop
        # reaches it.
        self._batch_seconds = 4 * timeout + 5.0
        self._token: _Token | None = None
        self._auth_failure: tuple[SendResult, float] | None = None
        self._token_lock = threading.Lock()
        self.token_fetches = 0  # for metrics and tests

    def send(self, wakeup: Wakeup) -> SendResult:
        """POST one raw wake-up; on a 401 refresh the token and try exactly once more."""
        if not channel_uri_allowed(wakeup.token, self._config.channel_hosts):
            return _not_allowed(wakeup)
        try:
            token = self._access_token()
            response = self._post(wakeup, token)
            if response.status_code == 401:
                logger.info("wns: 401 for push %s, refreshing the token once", wakeup.push_id)
                token = self._access_token(stale=token)
                response = self._post(wakeup, token)
        except _AuthError as exc:
            return exc.result
        except (httpx.HTTPError, httpx.InvalidURL, RuntimeError) as exc:
            return _failed_request(wakeup, exc)
        return _answered(wakeup, response.status_code, response.headers)

    def send_many(self, wakeups: list[Wakeup]) -> list[SendResult]:
        """The batch's requests side by side on the provider loop, one result per wake-up; the
        ones a 401 refused are sent once more with a refreshed token, as `send` does."""
        if self._loop_session.closed:
            # The app's credentials changed under an in-flight task: the retry uses the new ones.
            return [SendResult(Outcome.RETRY_LATER, "CLOSED")] * len(wakeups)
        results: list[SendResult | None] = [None] * len(wakeups)
        pending: list[int] = []
        for index, wakeup in enumerate(wakeups):
            if channel_uri_allowed(wakeup.token, self._config.channel_hosts):
                pending.append(index)
            else:
                results[index] = _not_allowed(wakeup)
        token: str | None = None
        for final in (False, True):
            if not pending:
                break
            try:
                token = self._access_token(stale=token)
            except (_AuthError, RuntimeError) as exc:  # RuntimeError: closed under the fetch
                failure = (
                    exc.result
                    if isinstance(exc, _AuthError)
                    else SendResult(Outcome.RETRY_LATER, "CLOSED")
                )
                for index in pending:
                    results[index] = failure
                break
            answers = self._post_batch([wakeups[index] for index in pending], token, final)
            refused = [i for i, answer in zip(pending, answers, strict=True) if answer is _REFUSED]
            for index, answer in zip(pending, answers, strict=True):
                results[index] = answer
            if refused:
                logger.info("wns: 401 for %d pushes, refreshing the token once", len(refused))
            pending = refused
        return [result or SendResult(Outcome.RETRY_LATER, "INTERNAL") for result in results]

    def _post_batch(self, wakeups: list[Wakeup], token: str, final: bool) -> list[SendResult]:
        """Each wake-up's result; _REFUSED for a 401 to try again (unless `final`)."""
        try:
            runner, session = self._loop_session.here()
        except ProviderClosed:
            return [SendResult(Outcome.RETRY_LATER, "CLOSED")] * len(wakeups)
        except (OSError, concurrent.futures.TimeoutError) as error:
            logger.warning("wns.client_not_built", extra={"error_type": type(error).__name__})
            return [SendResult(Outcome.RETRY_LATER, "NETWORK")] * len(wakeups)
        return runner.send_batch(
            self._post_all(session, wakeups, token, final), len(wakeups), self._batch_seconds
        )

    async def _post_all(
        self, session: aiohttp.ClientSession, wakeups: list[Wakeup], token: str, final: bool
    ) -> list[SendResult]:
        posts = (self._apost(session, wakeup, token, final) for wakeup in wakeups)
        return list(await asyncio.gather(*posts))

    async def _apost(
        self, session: aiohttp.ClientSession, wakeup: Wakeup, token: str, final: bool
    ) -> SendResult:
        content, headers = self._request(wakeup, token)
        try:
            async with session.post(
                wakeup.token, data=content, headers=headers, allow_redirects=False
            ) as response:
                await response.read()
                status, answer = response.status, response.headers
        except TimeoutError:  # aiohttp's connect and read timeouts are TimeoutErrors
            return _logged(wakeup, SendResult(Outcome.RETRY_LATER, "TIMEOUT"))
        except (aiohttp.ClientError, OSError) as exc:  # refused, reset, dropped
            logger.info("wns: push %s: %s", wakeup.push_id, type(exc).__name__)
            return _logged(wakeup, SendResult(Outcome.RETRY_LATER, "NETWORK"))
        except Exception as exc:  # one crash must not cost the batch its other results
            logger.exception("wns.send_crashed", extra={"error_type": type(exc).__name__})
            return SendResult(Outcome.RETRY_LATER, "INTERNAL")
        if status == 401 and not final:
            return _REFUSED
        return _answered(wakeup, status, answer)

    def close(self) -> None:
        """Drop the token and, if we made it, the connection pool."""
        with self._token_lock:
            self._token = None
        self._loop_session.close()
        if self._owns_client:
            self._client.close()

    # -- internals --

    def _request(self, wakeup: Wakeup, token: str) -> tuple[bytes, dict[str, str]]:
        """The raw notification's body and headers."""
        body = build_body(wakeup, self._payload)
        headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/octet-stream",
            "X-WNS-Type": "wns/raw",
            "X-WNS-RequestForStatus": "true",
            "X-WNS-Priority": "1" if wakeup.important else "3",
            "X-WNS-Cache-Policy": "cache" if wakeup.important else "no-cache",
        }
        return json.dumps(body, separators=(",", ":")).encode(), headers

    def _post(self, wakeup: Wakeup, token: str) -> httpx.Response:
        content, headers = self._request(wakeup, token)
        return self._client.post(
            wakeup.token, content=content, headers=headers, follow_redirects=False
        )

    def _access_token(self, stale: str | None = None) -> str:
        """The cached token, or one fresh fetch shared by every thread that needs it.

        `stale` is a token the channel just refused: drop it unless another thread has already
        replaced it.
        """
        token = self._token
        if token is not None and token.value != stale and self._clock() < token.refresh_at:
            return token.value
        with self._token_lock:
            now = self._clock()
            token = self._token
            if token is not None and token.value != stale and now < token.refresh_at:
                return token.value
            if self._auth_failure is not None and now < self._auth_failure[1]:
                raise _AuthError(self._auth_failure[0])
            self._token = None
            try:
                value, lifetime = self._fetch_token()
            except _AuthError as exc:
                hold = exc.result.retry_after if exc.result.retry_after else AUTH_FAILURE_HOLD
                self._auth_failure = (exc.result, now + min(hold, 60.0))
                raise
            self._auth_failure = None
            margin = min(TOKEN_EXPIRY_MARGIN, lifetime / 10)
            self._token = _Token(value, self._clock() + lifetime - margin)
            return value

    def _fetch_token(self) -> tuple[str, float]:
        """POST the client credentials; return (access token, lifetime in seconds)."""
        self.token_fetches += 1
        form = {
            "grant_type": "client_credentials",
            "client_id": self._config.package_sid,
            "client_secret": self._config.secret,
            "scope": TOKEN_SCOPE,
        }
        try:
            response = self._client.post(self._config.token_url, data=form, follow_redirects=False)
        except httpx.TimeoutException:
            raise self._auth_error(Outcome.RETRY_LATER, "AUTH_TIMEOUT") from None
        except httpx.TransportError as exc:
            logger.warning("wns: token endpoint unreachable: %s", type(exc).__name__)
            raise self._auth_error(Outcome.RETRY_LATER, "AUTH_NETWORK") from None
        except (httpx.HTTPError, httpx.InvalidURL):
            raise self._auth_error(Outcome.FAILED, "AUTH") from None
        code = response.status_code
        if code == 429 or code >= 500:
            retry_after = parse_retry_after(response.headers.get("Retry-After"))
            raise self._auth_error(Outcome.RETRY_LATER, f"AUTH_HTTP_{code}", retry_after)
        if code != 200:
            raise self._auth_error(Outcome.FAILED, "AUTH", oauth_error=_oauth_error(response))
        try:
            answer = response.json()
            value = answer["access_token"]
            token_type = str(answer.get("token_type", "bearer")).lower()
        except (ValueError, KeyError, TypeError, AttributeError):
            raise self._auth_error(Outcome.RETRY_LATER, "AUTH_BAD_RESPONSE") from None
        if not isinstance(value, str) or not _URI_CHARS.fullmatch(value) or token_type != "bearer":
            raise self._auth_error(Outcome.RETRY_LATER, "AUTH_BAD_RESPONSE")
        try:
            lifetime = float(answer.get("expires_in", DEFAULT_TOKEN_LIFETIME))
        except (TypeError, ValueError):
            lifetime = DEFAULT_TOKEN_LIFETIME
        if not 0 < lifetime < 10 * DEFAULT_TOKEN_LIFETIME:
            lifetime = DEFAULT_TOKEN_LIFETIME
        return value, lifetime

    @staticmethod
    def _auth_error(
        outcome: Outcome, code: str, retry_after: float | None = None, oauth_error: str = ""
    ) -> _AuthError:
        logger.warning("wns: no access token: %s %s", code, oauth_error)
        return _AuthError(SendResult(outcome, code, retry_after))


def _oauth_error(response: httpx.Response) -> str:
    """The OAuth "error" code (e.g. invalid_client): safe to log, unlike the description."""
    try:
        error = response.json().get("error", "")
    except (ValueError, AttributeError):
        error = ""
    if isinstance(error, str) and re.fullmatch(r"[a-z_]{1,64}", error):
        return error
    return f"HTTP {response.status_code}"
