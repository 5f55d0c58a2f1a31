"""Firebase Cloud Messaging (HTTP v1) through the real firebase-admin client.

The wire payload is a content-free wake-up (docs/protocols.md 1.4): the device's token, the account
hash (plus the room hash for a room), a collapse key and the Android priority. The provider sees
hashes only, never a JID or a body.

Sends go through firebase-admin's public API (`messaging.send`; its exceptions are classified
here). What has no public way (the endpoint, the library's retries, google-auth's regional
access boundary lookup) is in `relay.providers.fcm_endpoint`, the one module that touches
firebase-admin's private names.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

import firebase_admin
import google.auth.exceptions
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from firebase_admin import credentials, exceptions, messaging
from google.auth.transport.requests import Request as GoogleAuthRequest

from relay.providers import fcm_endpoint
from relay.providers.base import DEFAULT_TIMEOUT_SECONDS, Outcome, SendResult, Wakeup
from relay.providers.fcm_endpoint import GOOGLE_FCM_ENDPOINT
from relay.providers.payloads import FcmPayload

logger = logging.getLogger(__name__)

DEFAULT_PAYLOAD = FcmPayload()
_REQUIRED_FIELDS = ("project_id", "client_email", "private_key", "token_uri")
_FCM_ERROR_TYPE = "type.googleapis.com/google.firebase.fcm.v1.FcmError"
_BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"
# Statuses that mean "FCM or the path to it is having a moment": try again later.
_TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_FCM_CODES = frozenset({"QUOTA_EXCEEDED", "UNAVAILABLE", "INTERNAL"})
# Threads shared by this provider's `send_many` batches (the session's pool holds 100
# connections; RELAY MAX_IN_FLIGHT_PER_PROVIDER bounds what is actually in flight).
SEND_MANY_THREADS = 64


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


def _retry_after(response: requests.Response | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP-date), if there is one."""
    if response is None:
        return None
    value = response.headers.get("Retry-After", "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_body(response: requests.Response | None) -> dict[str, Any]:
    if response is None:
        return {}
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
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


def classify(error: Exception) -> SendResult:
    """Map a firebase-admin / google-auth failure to an outcome.

    - UNREGISTERED, SENDER_ID_MISMATCH, INVALID_ARGUMENT about the token: DEAD_TOKEN (the
      device's address will never work again with this sender).
    - INVALID_ARGUMENT about anything else: FAILED (our own message is wrong; the token may
      be fine, so it must not be killed).
    - QUOTA_EXCEEDED/429, UNAVAILABLE/503, INTERNAL/500, other 5xx, 408, timeouts, refused or
      dropped connections, a token endpoint that is down or says "try again": RETRY_LATER,
      with `retry_after` from a Retry-After header when FCM sends one.
    - THIRD_PARTY_AUTH_ERROR, 401 (after google-auth's own refresh-and-retry), 403, 404 without
      UNREGISTERED, a token endpoint that refuses our key: FAILED. These are the operator's
      credentials or project, not the device, and retrying with backoff will not fix them.

    `error_code` is FCM's errorCode, else `HTTP_<status>`, else NETWORK / TIMEOUT / OAUTH_*;
    never an exception message (FCM may echo the token in one).
    """
    if isinstance(error, google.auth.exceptions.RefreshError):
        if getattr(error, "retryable", False):
            return SendResult(Outcome.RETRY_LATER, "OAUTH_UNAVAILABLE")
        return SendResult(Outcome.FAILED, "OAUTH_REFUSED")
    if isinstance(error, google.auth.exceptions.TransportError):
        return SendResult(Outcome.RETRY_LATER, "OAUTH_NETWORK")
    if isinstance(error, google.auth.exceptions.GoogleAuthError):
        return SendResult(Outcome.FAILED, "OAUTH_ERROR")
    if not isinstance(error, exceptions.FirebaseError):
        raise TypeError(f"not a provider error: {error.__class__.__name__}") from error

    response = error.http_response
    if response is None:
        if isinstance(error, exceptions.DeadlineExceededError):
            return SendResult(Outcome.RETRY_LATER, "TIMEOUT")
        return SendResult(Outcome.RETRY_LATER, "NETWORK")

    status = response.status_code
    body = _error_body(response)
    fcm_code = _fcm_error_code(body)
    code = fcm_code or f"HTTP_{status}"
    if fcm_code in ("UNREGISTERED", "SENDER_ID_MISMATCH"):
        return SendResult(Outcome.DEAD_TOKEN, code)
    if fcm_code == "INVALID_ARGUMENT" or (not fcm_code and status == 400):
        outcome = Outcome.DEAD_TOKEN if _is_about_token(body) else Outcome.FAILED
        return SendResult(outcome, code)
    if fcm_code in _TRANSIENT_FCM_CODES or status in _TRANSIENT_HTTP or status >= 500:
        return SendResult(Outcome.RETRY_LATER, code, _retry_after(response))
    return SendResult(Outcome.FAILED, code)


def build_message(wakeup: Wakeup, payload: FcmPayload | None = None) -> messaging.Message:
    """The whole payload of docs/protocols.md 1.4, nothing else (unless the app's payload options
    rename the keys, add the push id, or a notification block for important pushes).

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
    notification = None
    if wakeup.important and (payload.notification_title or payload.notification_body):
        notification = messaging.Notification(
            title=payload.notification_title or None, body=payload.notification_body or None
        )
    message = messaging.Message(
        data=data,
        notification=notification,
        android=messaging.AndroidConfig(
            collapse_key=(wakeup.channel or wakeup.account)[:6],
            priority="high" if wakeup.important else "normal",
        ),
    )
    # 7.7.0 deprecates `token=` in favour of `fid=` (a Firebase installation ID, a different
    # address); phones register FCM tokens. Setting the attribute keeps the wire field `token`
    # without a DeprecationWarning (warnings.catch_warnings is not thread-safe).
    message.token = wakeup.token
    return message


class FcmProvider:
    """Sends wake-ups for one Firebase project; safe to share between threads.

    Each instance owns a uniquely named firebase_admin.App (deleted in `close`), so apps with
    different credentials or endpoints never share state. The OAuth token is fetched from the
    service account's `token_uri` once (under a lock, so a burst of threads fetches it once)
    and reused until google-auth considers it stale.
    """

    service: ClassVar[str] = "fcm"

    def __init__(
        self, config: FcmConfig, *, timeout: float | None = None, payload: FcmPayload | None = None
    ) -> None:
        self.config = config
        self.payload = payload or DEFAULT_PAYLOAD
        self.timeout = DEFAULT_TIMEOUT_SECONDS if timeout is None else float(timeout)
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None
        self._token_lock = threading.Lock()
        self._close_lock = threading.Lock()
        certificate = credentials.Certificate(dict(config.service_account))
        self._app = firebase_admin.initialize_app(
            certificate,
            options={"httpTimeout": self.timeout, "projectId": config.project_id},
            name=f"relay-fcm-{uuid.uuid4().hex}",
        )
        try:
            # The same credential object the app's sends authorize with.
            self._credential = certificate.get_credential()
            self.send_url = fcm_endpoint.point_at(self._app, self._credential, config.endpoint)
            self._token_session = requests.Session()
            self._token_request = functools.partial(
                GoogleAuthRequest(self._token_session), timeout=self.timeout
            )
        except BaseException:
            firebase_admin.delete_app(self._app)
            raise

    def __repr__(self) -> str:
        return f"<FcmProvider project={self.config.project_id} url={self.send_url}>"

    def _ensure_token(self) -> None:
        # google-auth refreshes without a lock: without this, N threads starting together
        # would each fetch a token.
        if self._credential.valid:
            return
        with self._token_lock:
            if not self._credential.valid:
                self._credential.refresh(self._token_request)

    def send(self, wakeup: Wakeup) -> SendResult:
        if self._closed:
            # The app's credentials changed under an in-flight task: the retry uses the new ones.
            return SendResult(Outcome.RETRY_LATER, "CLOSED")
        if not wakeup.token:
            return SendResult(Outcome.DEAD_TOKEN, "EMPTY_TOKEN")
        message = build_message(wakeup, self.payload)
        try:
            self._ensure_token()
            messaging.send(message, app=self._app)
        except (exceptions.FirebaseError, google.auth.exceptions.GoogleAuthError) as error:
            return self._not_delivered(wakeup, classify(error))
        except ValueError:
            if self._closed:  # the App was deleted under this send
                return SendResult(Outcome.RETRY_LATER, "CLOSED")
            raise
        return SendResult.delivered()

    def send_many(self, wakeups: list[Wakeup]) -> list[SendResult]:
        """A batch as `send` each, over a thread pool this provider's batches share.

        Not `messaging.send_each`: it starts a thread per message on every call, and a token
        endpoint failure inside it fails the whole batch as one UnknownError.
        """
        with self._close_lock:
            if self._closed:
                return [SendResult(Outcome.RETRY_LATER, "CLOSED")] * len(wakeups)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=SEND_MANY_THREADS, thread_name_prefix="fcm-send"
                )
            pool = self._pool
        try:
            return list(pool.map(self._send_guarded, wakeups))
        except RuntimeError:  # the pool was shut down by a concurrent close()
            return [SendResult(Outcome.RETRY_LATER, "CLOSED")] * len(wakeups)

    def _send_guarded(self, wakeup: Wakeup) -> SendResult:
        try:
            return self.send(wakeup)
        except Exception as error:  # one crash must not cost the batch its other results
            logger.exception("fcm send crashed", extra={"error_type": type(error).__name__})
            return SendResult(Outcome.RETRY_LATER, "INTERNAL")

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
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        fcm_endpoint.close_connections(self._app)
        self._token_session.close()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            firebase_admin.delete_app(self._app)
            return
        # delete_app closes the async client with asyncio.run(), which fails inside a loop.
        worker = threading.Thread(target=firebase_admin.delete_app, args=(self._app,))
        worker.start()
        worker.join()
