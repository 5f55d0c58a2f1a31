"""Firebase Cloud Messaging through its documented HTTP v1 REST API, authorized with the
service account's credential from firebase-admin.

The wire payload is a content-free wake-up (docs/protocols.md 1.4): the device's token, the account
hash (plus the room hash for a room), a collapse key and the Android priority. The provider sees
hashes only, never a JID or a body.

Why the REST API and not `firebase_admin.messaging.send`: a send is one documented request
(`POST {endpoint}/v1/projects/{project}/messages:send` with `{"message": ...}` and a Bearer
access token, https://firebase.google.com/docs/reference/fcm/rest/v1/projects.messages/send),
and its errors are the documented google.rpc.Status with a `google.firebase.fcm.v1.FcmError`
detail. Through `messaging.send` every send also ran requests' per-request work and
google-auth's AuthorizedSession: more than twice this path's CPU per send, at a lower rate
(docs/benchmarks.md, "Providers", has the figures, measured back to back); and the endpoint,
the library's retries and google-auth's regional access boundary lookup could only be changed
through private names. Here the URL is ours (the app's endpoint setting), the requests go
without retries (the relay's queue retries with its own backoff), and the access token comes
from the credential firebase-admin holds for the app
(`App.credential.get_credential()`), refreshed with google-auth's public `Credentials.refresh`
within the provider timeout. Nothing private of either library is used. `refresh` does not
start google-auth's regional access boundary lookup (only `before_request` does, which this
module never calls); tests/test_fcm_provider.py checks that against the installed google-auth.

Two ways out, one route (`Route`: the proxy and CA bundle) and one classification:
- a batch (`send_many`) leaves from the process's provider loop
  (`relay.providers.base.shared_loop`) over aiohttp, its requests side by side on that one
  thread: a thread per request costs more CPU in waking threads and handing the GIL between
  them than in sending (docs/benchmarks.md, "A batch's FCM requests on one loop");
- a lone wake-up (`send`, what a gateway sends at an everyday rate) leaves from the caller's
  thread over urllib3: a hop to the loop and back would be two more thread switches than
  the request itself.

Classification (`classify_answer`, `classify_auth_error`):

===============================================  ===========  ============================
FCM's answer                                     Outcome      error_code
===============================================  ===========  ============================
2xx                                              DELIVERED    ""
UNREGISTERED, SENDER_ID_MISMATCH                 DEAD_TOKEN   the errorCode
INVALID_ARGUMENT (or a bare 400) about the token DEAD_TOKEN   INVALID_ARGUMENT / HTTP_400
INVALID_ARGUMENT (or a bare 400), anything else  FAILED       INVALID_ARGUMENT / HTTP_400
QUOTA_EXCEEDED, UNAVAILABLE, INTERNAL,           RETRY_LATER  the errorCode or HTTP_<code>,
408, 429, 5xx                                                 with Retry-After if sent
401 after two token refreshes, 403, 404 without  FAILED       the errorCode (such as
UNREGISTERED, THIRD_PARTY_AUTH_ERROR                          THIRD_PARTY_AUTH_ERROR) or
                                                              HTTP_<code>
timeout / refused or dropped connection          RETRY_LATER  TIMEOUT / NETWORK
token endpoint refuses the key                   FAILED       OAUTH_REFUSED
token endpoint says "try again" / unreachable    RETRY_LATER  OAUTH_UNAVAILABLE / _NETWORK
===============================================  ===========  ============================

A token's failures are the device's (DEAD_TOKEN); a refused credential, project or message is
the operator's (FAILED: backoff will not fix it); the rest passes (RETRY_LATER). `error_code`
is never an exception message or FCM's text (FCM may echo the token in one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import ssl
import threading
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

import aiohttp
import firebase_admin
import google.auth.exceptions
import requests
import requests.certs
import urllib3
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from firebase_admin import credentials
from google.auth.transport.requests import Request as GoogleAuthRequest

from relay.providers.base import (
    DEFAULT_TIMEOUT_SECONDS,
    LoopSession,
    Outcome,
    ProviderClosed,
    SendResult,
    Wakeup,
    parse_retry_after,
)
from relay.providers.payloads import FcmPayload

logger = logging.getLogger(__name__)

GOOGLE_FCM_ENDPOINT = "https://fcm.googleapis.com"
DEFAULT_PAYLOAD = FcmPayload()
_REQUIRED_FIELDS = ("project_id", "client_email", "private_key", "token_uri")
_FCM_ERROR_TYPE = "type.googleapis.com/google.firebase.fcm.v1.FcmError"
_BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"
# Statuses that mean "FCM or the path to it is having a moment": try again later.
_TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_FCM_CODES = frozenset({"QUOTA_EXCEEDED", "UNAVAILABLE", "INTERNAL"})
# Connections kept open to the endpoint for the lone sends (the callers' threads).
POOL_CONNECTIONS = 100
# Every send's headers besides the token. X-GOOG-API-FORMAT-VERSION 2 is what firebase-admin's
# clients send to ask FCM for its detailed errors (the google.rpc.BadRequest field violations
# `_is_about_token` reads).
_HEADERS = {"Content-Type": "application/json", "X-GOOG-API-FORMAT-VERSION": "2"}
# Times a send refused with 401 gets a new access token and is repeated (what google-auth's
# AuthorizedSession does, which firebase-admin sends through).
AUTH_REFRESHES = 2


def _check_url(value: str, what: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{what} must be an http(s) URL, got {value!r}")
    return value


@dataclass(frozen=True)
class FcmConfig:
    """One Firebase project's credentials and where to send (Google, or a fake in tests).

    `service_account` holds a private key: it is left out of repr so it never lands in a log
    or a traceback.
    """

    service_account: dict[str, Any] = field(repr=False, hash=False)
    endpoint: str = GOOGLE_FCM_ENDPOINT

    @property
    def project_id(self) -> str:
        return str(self.service_account.get("project_id", ""))

    @property
    def client_email(self) -> str:
        return str(self.service_account.get("client_email", ""))

    @classmethod
    def parse(cls, service_account_json: str, endpoint: str = "") -> FcmConfig:
        """Validate an uploaded service-account JSON now, so a bad upload fails in the admin
        form instead of at the first push. Raises ValueError with a message safe to show."""
        try:
            info = json.loads(service_account_json)
        except (TypeError, ValueError) as exc:
            # json's messages give a position, never the document's text.
            raise ValueError(f"The service account is not valid JSON: {exc}.") from None
        if not isinstance(info, dict):
            raise ValueError("The service account JSON must be an object.")
        if info.get("type") != "service_account":
            raise ValueError('The service account JSON must have "type": "service_account".')
        missing = [name for name in _REQUIRED_FIELDS if not info.get(name)]
        if missing:
            raise ValueError(f"The service account JSON lacks {', '.join(missing)}.")
        not_text = [name for name in _REQUIRED_FIELDS if not isinstance(info[name], str)]
        if not_text:
            raise ValueError(f"The service account fields {', '.join(not_text)} must be text.")
        _check_url(info["token_uri"], "token_uri")
        try:
            key = serialization.load_pem_private_key(info["private_key"].encode(), password=None)
        except (TypeError, ValueError) as exc:
            # Never echo the key; the exception class says enough.
            raise ValueError(
                f"The service account private_key does not load ({exc.__class__.__name__})."
            ) from None
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("The service account private_key must be an RSA key.")
        endpoint = endpoint.strip() or GOOGLE_FCM_ENDPOINT
        _check_url(endpoint, "The FCM endpoint")
        return cls(service_account=info, endpoint=endpoint.rstrip("/"))


def send_url(endpoint: str, project_id: str) -> str:
    """projects.messages.send of the v1 API under `endpoint` (Google's, or a fake's)."""
    return f"{endpoint.rstrip('/')}/v1/projects/{project_id}/messages:send"


def build_message(wakeup: Wakeup, payload: FcmPayload | None = None) -> dict[str, Any]:
    """The v1 request body: the whole payload of docs/protocols.md 1.4, nothing else (unless
    the app's payload options rename the keys, add the push id, or a notification block for
    important pushes).

    collapse_key: the first 6 characters of the room hash for a room, else of the account
    hash, so FCM keeps one pending wake-up per account or room (a newer one replaces an
    undelivered older one) while different rooms/accounts do not swallow each other.
    """
    payload = payload or DEFAULT_PAYLOAD
    data = {payload.account_key: wakeup.account}
    if wakeup.channel:
        data[payload.channel_key] = wakeup.channel
    if payload.push_id_key:
        data[payload.push_id_key] = wakeup.push_id
    message: dict[str, Any] = {
        "token": wakeup.token,
        "data": data,
        "android": {
            "collapse_key": (wakeup.channel or wakeup.account)[:6],
            "priority": "high" if wakeup.important else "normal",
        },
    }
    if wakeup.important and (payload.notification_title or payload.notification_body):
        texts = {"title": payload.notification_title, "body": payload.notification_body}
        message["notification"] = {name: text for name, text in texts.items() if text}
    return {"message": message}


def _error_body(body: bytes) -> dict[str, Any]:
    """The `error` object of FCM's answer (a google.rpc.Status), or {}."""
    try:
        document = json.loads(body)
    except ValueError:
        return {}
    error = document.get("error") if isinstance(document, dict) else None
    return error if isinstance(error, dict) else {}


def _fcm_error_code(error: dict[str, Any]) -> str:
    for detail in error.get("details") or []:
        if isinstance(detail, dict) and detail.get("@type") == _FCM_ERROR_TYPE:
            return str(detail.get("errorCode") or "")
    return ""


def _is_about_token(error: dict[str, Any]) -> bool:
    """True when an INVALID_ARGUMENT blames the registration token, not our message.

    FCM names the field in a google.rpc.BadRequest detail (`message.token`); older answers only
    say so in the message ("The registration token is not a valid FCM registration token").
    """
    for detail in error.get("details") or []:
        if isinstance(detail, dict) and detail.get("@type") == _BAD_REQUEST_TYPE:
            for violation in detail.get("fieldViolations") or []:
                if isinstance(violation, dict) and violation.get("field") == "message.token":
                    return True
    return "registration token" in str(error.get("message", "")).lower()


def classify_answer(status: int, body: bytes, retry_after: str | None = None) -> SendResult:
    """FCM's answer to a send that was not a 2xx (the table in the module docstring)."""
    error = _error_body(body)
    fcm_code = _fcm_error_code(error)
    code = fcm_code or f"HTTP_{status}"
    if fcm_code in ("UNREGISTERED", "SENDER_ID_MISMATCH"):
        return SendResult(Outcome.DEAD_TOKEN, code)
    if fcm_code == "INVALID_ARGUMENT" or (not fcm_code and status == 400):
        outcome = Outcome.DEAD_TOKEN if _is_about_token(error) else Outcome.FAILED
        return SendResult(outcome, code)
    if fcm_code in _TRANSIENT_FCM_CODES or status in _TRANSIENT_HTTP or status >= 500:
        return SendResult(Outcome.RETRY_LATER, code, parse_retry_after(retry_after))
    return SendResult(Outcome.FAILED, code)


def classify_auth_error(error: google.auth.exceptions.GoogleAuthError) -> SendResult:
    """A failed access token fetch: our key refused is the operator's to fix; a token endpoint
    that is down or asks to try again passes."""
    if isinstance(error, google.auth.exceptions.RefreshError):
        if getattr(error, "retryable", False):
            return SendResult(Outcome.RETRY_LATER, "OAUTH_UNAVAILABLE")
        return SendResult(Outcome.FAILED, "OAUTH_REFUSED")
    if isinstance(error, google.auth.exceptions.TransportError):
        return SendResult(Outcome.RETRY_LATER, "OAUTH_NETWORK")
    return SendResult(Outcome.FAILED, "OAUTH_ERROR")


@dataclass(frozen=True, slots=True)
class Route:
    """How a provider's sends leave, with what requests would take from the environment for
    its URL, read once: the proxy (unless NO_PROXY names the host) and the CA bundle,
    `ca_bundle` (the services pass REQUESTS_CA_BUNDLE, else CURL_CA_BUNDLE) or certifi's."""

    ca_bundle: str
    proxy: str | None = None
    proxy_auth: aiohttp.BasicAuth | None = None

    @classmethod
    def for_url(cls, url: str, ca_bundle: str = "") -> Route:
        parts = urlsplit(url)
        bundle = ca_bundle or requests.certs.where()
        proxy = urllib.request.getproxies().get(parts.scheme)
        if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
            return cls(bundle)
        address = urlsplit(proxy)
        if address.username is None:
            return cls(bundle, proxy)
        auth = aiohttp.BasicAuth(unquote(address.username), unquote(address.password or ""))
        host = address.netloc.rpartition("@")[2]
        return cls(bundle, address._replace(netloc=host).geturl(), auth)

    def pool(self) -> urllib3.PoolManager:
        """The connections of the lone sends (`FcmProvider.send`)."""
        options: dict[str, Any] = {
            "maxsize": POOL_CONNECTIONS,
            "cert_reqs": "CERT_REQUIRED",
            "ca_certs": self.ca_bundle,
        }
        if self.proxy is None:
            return urllib3.PoolManager(**options)
        auth = self.proxy_auth
        headers = (
            urllib3.make_headers(proxy_basic_auth=f"{auth.login}:{auth.password}") if auth else None
        )
        return urllib3.ProxyManager(self.proxy, proxy_headers=headers, **options)

    def tls(self) -> ssl.SSLContext:
        """Built when the provider makes its first connection (a bundle read at start-up would
        fail the provider's construction, not its sends)."""
        return ssl.create_default_context(cafile=self.ca_bundle)


_EMPTY_TOKEN = SendResult(Outcome.DEAD_TOKEN, "EMPTY_TOKEN")


class FcmProvider:
    """Sends wake-ups for one Firebase project; safe to share between threads.

    Each instance owns a uniquely named firebase_admin.App (deleted in `close`), whose
    credential is the service account's. The OAuth access token is fetched from its
    `token_uri` once (under a lock, so a burst of threads fetches it once) and reused until
    google-auth considers it stale (shortly before it expires), or until FCM refuses it.
    """

    service: ClassVar[str] = "fcm"

    def __init__(
        self,
        config: FcmConfig,
        *,
        timeout: float | None = None,
        payload: FcmPayload | None = None,
        ca_bundle: str = "",
    ) -> None:
        self.config = config
        self.payload = payload or DEFAULT_PAYLOAD
        self.timeout = DEFAULT_TIMEOUT_SECONDS if timeout is None else float(timeout)
        self.send_url = send_url(config.endpoint, config.project_id)
        self.route = Route.for_url(self.send_url, ca_bundle)
        self._token_lock = threading.Lock()
        self._loop_session = LoopSession(
            timeout=aiohttp.ClientTimeout(sock_connect=self.timeout, sock_read=self.timeout),
            build_timeout=self.timeout,
            tls=lambda: self.route.tls() if urlsplit(self.send_url).scheme == "https" else None,
        )
        self._http = self.route.pool()
        self._http_timeout = urllib3.Timeout(connect=self.timeout, read=self.timeout)
        # What a batch may take at most, every refresh and request at its timeout: only a
        # wedged loop reaches it.
        self._batch_seconds = (AUTH_REFRESHES + 1) * 3 * self.timeout + 5.0
        self._token_session = requests.Session()
        if ca_bundle:
            self._token_session.verify = ca_bundle
        # The bundle given per request: requests would otherwise take REQUESTS_CA_BUNDLE from
        # the process's environment over the session's.
        self._token_request = functools.partial(
            GoogleAuthRequest(self._token_session),
            timeout=self.timeout,
            verify=self.route.ca_bundle,
        )
        self._app = firebase_admin.initialize_app(
            credentials.Certificate(dict(config.service_account)),
            options={"projectId": config.project_id},
            name=f"relay-fcm-{uuid.uuid4().hex}",
        )
        # google-auth's service-account credential: `token`, `valid` and `refresh` are public.
        self._credential = self._app.credential.get_credential()

    def __repr__(self) -> str:
        return f"<FcmProvider project={self.config.project_id} url={self.send_url}>"

    def _authorization(self, refused: str = "") -> str:
        """`Bearer <access token>`: a new token when there is none, google-auth calls it stale,
        or FCM just refused `refused` (unless another thread has replaced that one already).
        google-auth refreshes without a lock; without this one, N threads starting together
        would each fetch a token."""
        current = self._current_authorization(refused)
        if current:
            return current
        with self._token_lock:
            token = self._credential.token
            if not (token and self._credential.valid) or f"Bearer {token}" == refused:
                self._credential.refresh(self._token_request)
            return f"Bearer {self._credential.token}"

    def _current_authorization(self, refused: str) -> str:
        """The token held, if it is valid and not the one FCM refused; else ""."""
        token = self._credential.token
        if token and self._credential.valid and f"Bearer {token}" != refused:
            return f"Bearer {token}"
        return ""

    async def _authorization_async(self, refused: str = "") -> str:
        """`_authorization` on the loop: a fetch (a blocking request) runs in the loop's
        executor, so that the other sends go on meanwhile."""
        current = self._current_authorization(refused)
        if current:
            return current
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._authorization, refused)

    def send(self, wakeup: Wakeup) -> SendResult:
        if self._loop_session.closed:
            # The app's credentials changed under an in-flight task: the retry uses the new ones.
            return SendResult(Outcome.RETRY_LATER, "CLOSED")
        if not wakeup.token:
            return _EMPTY_TOKEN
        body, refused = self._request_body(wakeup), ""
        for _ in range(AUTH_REFRESHES + 1):
            try:
                authorization = self._authorization(refused)
            except google.auth.exceptions.GoogleAuthError as error:
                return self._not_delivered(wakeup, classify_auth_error(error))
            try:
                answer = self._http.request(
                    "POST",
                    self.send_url,
                    body=body,
                    headers={**_HEADERS, "Authorization": authorization},
                    timeout=self._http_timeout,
                    retries=False,
                    redirect=False,
                )
            except urllib3.exceptions.NewConnectionError:  # (a ConnectTimeoutError subclass)
                return self._not_delivered(wakeup, SendResult(Outcome.RETRY_LATER, "NETWORK"))
            except urllib3.exceptions.TimeoutError:
                return self._not_delivered(wakeup, SendResult(Outcome.RETRY_LATER, "TIMEOUT"))
            except urllib3.exceptions.HTTPError:
                return self._not_delivered(wakeup, SendResult(Outcome.RETRY_LATER, "NETWORK"))
            if answer.status != 401:
                return self._answered(wakeup, answer.status, answer.data, answer.headers)
            # A token revoked before its time: a new one, and the send repeated.
            refused = authorization
        return self._answered(wakeup, answer.status, answer.data, answer.headers)

    def _request_body(self, wakeup: Wakeup) -> bytes:
        return json.dumps(build_message(wakeup, self.payload)).encode()

    def _answered(
        self, wakeup: Wakeup, status: int, body: bytes, headers: Mapping[str, str]
    ) -> SendResult:
        if 200 <= status < 300:
            return SendResult.delivered()
        return self._not_delivered(
            wakeup, classify_answer(status, body, headers.get("Retry-After"))
        )

    def send_many(self, wakeups: list[Wakeup]) -> list[SendResult]:
        """The batch's requests side by side on the provider loop; one result per wake-up."""
        try:
            runner, session = self._loop_session.here()
        except ProviderClosed:
            # The app's credentials changed under an in-flight task: the retry uses the new ones.
            return [SendResult(Outcome.RETRY_LATER, "CLOSED")] * len(wakeups)
        except (OSError, ssl.SSLError, concurrent.futures.TimeoutError) as error:
            logger.warning("fcm client not built", extra={"error_type": type(error).__name__})
            result = SendResult(Outcome.RETRY_LATER, "NETWORK")
            return [self._not_delivered(wakeup, result) for wakeup in wakeups]
        return runner.send_batch(
            self._send_all(session, wakeups), len(wakeups), self._batch_seconds
        )

    async def _send_all(
        self, session: aiohttp.ClientSession, wakeups: list[Wakeup]
    ) -> list[SendResult]:
        return list(await asyncio.gather(*(self._send_guarded(session, w) for w in wakeups)))

    async def _send_guarded(self, session: aiohttp.ClientSession, wakeup: Wakeup) -> SendResult:
        try:
            return await self._send(session, wakeup)
        except Exception as error:  # one crash must not cost the batch its other results
            logger.exception("fcm send crashed", extra={"error_type": type(error).__name__})
            return SendResult(Outcome.RETRY_LATER, "INTERNAL")

    async def _send(self, session: aiohttp.ClientSession, wakeup: Wakeup) -> SendResult:
        if not wakeup.token:
            return _EMPTY_TOKEN
        body, refused = self._request_body(wakeup), ""
        for _ in range(AUTH_REFRESHES + 1):
            try:
                authorization = await self._authorization_async(refused)
            except google.auth.exceptions.GoogleAuthError as error:
                return self._not_delivered(wakeup, classify_auth_error(error))
            try:
                async with session.post(
                    self.send_url,
                    data=body,
                    headers={**_HEADERS, "Authorization": authorization},
                    allow_redirects=False,
                    proxy=self.route.proxy,
                    proxy_auth=self.route.proxy_auth,
                ) as answer:
                    status, data, headers = answer.status, await answer.read(), answer.headers
            except TimeoutError:  # aiohttp's connect and read timeouts are TimeoutErrors
                return self._not_delivered(wakeup, SendResult(Outcome.RETRY_LATER, "TIMEOUT"))
            except (aiohttp.ClientError, OSError):  # refused, dropped, TLS refused, closed
                return self._not_delivered(wakeup, SendResult(Outcome.RETRY_LATER, "NETWORK"))
            if status != 401:
                return self._answered(wakeup, status, data, headers)
            refused = authorization  # as in `send`
        return self._answered(wakeup, status, data, headers)

    def _not_delivered(self, wakeup: Wakeup, result: SendResult) -> SendResult:
        log = logger.warning if result.outcome == Outcome.FAILED else logger.info
        log(
            "fcm send not delivered",
            extra={
                "push_id": wakeup.push_id,
                "project": self.config.project_id,
                "outcome": str(result.outcome),
                "error_code": result.error_code,
                "retry_after": result.retry_after,
            },
        )
        return result

    def close(self) -> None:
        """Close connections and delete the firebase App; idempotent."""
        if not self._loop_session.close():
            return
        self._http.clear()
        self._token_session.close()
        firebase_admin.delete_app(self._app)
