"""What the web process does with the push resource: POST stores, GET discovers, DELETE
withdraws. Views call these and turn `PushRefused` into the status it names.

| situation                                                  | answer                     |
|------------------------------------------------------------|----------------------------|
| token malformed, tampered, truncated, foreign key, expired | 404                        |
| endpoint revoked (the phone said item-not-found)           | 404                        |
| component gone, disabled or not serving UnifiedPush        | 404                        |
| body over 4096 bytes                                       | 413                        |
| TTL, Topic or Urgency malformed                            | 400                        |
| too many POSTs for this endpoint or this tenant            | 429 + Retry-After          |
| tenant suspended, database down                            | 503 + Retry-After          |
| stored                                                     | 201 + Location + TTL       |
"""

from __future__ import annotations

import base64
import binascii
import hmac
import math
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import DatabaseError

from relay import conf
from relay.models import Component
from relay.services import link_leases
from relay.unifiedpush import endpoint_urls
from relay.unifiedpush.models import UnifiedPushUrgency, settings_of
from relay.unifiedpush.services import channel, store, tokens
from relay.unifiedpush.services.keys import KeyRing, keyring
from relay.unifiedpush.services.limits import TokenBuckets
from relay.unifiedpush.services.registration import PUSH_PATH

MAX_BODY_BYTES = 4096
POLICY_SECONDS = 5.0  # how long a web process trusts what it read about a component
MESSAGE_PATH = PUSH_PATH + "message/"
_TOPIC = re.compile(r"[A-Za-z0-9_-]{1,32}")
_URGENCY = {choice.label: choice.value for choice in UnifiedPushUrgency}


class ColdCache(Exception):
    """What a POST needs is not cached here: run it where a database read may wait."""


class PushRefused(Exception):
    def __init__(self, status: int, reason: str, retry_after: int | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


NOT_FOUND = 404


@dataclass(frozen=True, slots=True)
class Accepted:
    message_id: int
    location: str
    ttl: int
    urgency: str


@dataclass(frozen=True, slots=True)
class Policy:
    """What a POST needs to know about a component and its tenant (cached per process)."""

    component_id: int
    tenant_id: int
    serves: bool
    suspended: bool
    endpoint_url: str
    tenant_rate: float | None
    tenant_burst: float | None
    channel: str = ""  # the direct path to the gateway holding the link, if one announced it


class _PolicyCache:
    def __init__(self) -> None:
        self._entries: dict[int, tuple[float, Policy | None]] = {}
        self._refreshing: set[int] = set()
        self._lock = threading.Lock()

    def get(self, component_id: int, *, cached_only: bool = False) -> Policy | None:
        """The component's policy. `cached_only` (an event loop, which must not wait for the
        database): ColdCache when it has to be read; once it is merely stale, only the first
        such caller gets ColdCache and reads it in a thread, the others go on with the stale
        entry meanwhile (up to one more lifetime), instead of all reading it at once."""
        now = time.monotonic()
        entry = self._entries.get(component_id)
        if entry is not None and entry[0] > now:
            return entry[1]
        if cached_only:
            if entry is not None and entry[0] + POLICY_SECONDS > now:
                with self._lock:
                    if component_id in self._refreshing:
                        return entry[1]
                    self._refreshing.add(component_id)
            raise ColdCache
        try:
            policy = _read_policy(component_id)
        finally:
            with self._lock:
                self._refreshing.discard(component_id)
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[component_id] = (now + POLICY_SECONDS, policy)
        return policy

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._refreshing.clear()


def _read_policy(component_id: int) -> Policy | None:
    component = (
        Component.objects.select_related("tenant", "unifiedpush_settings")
        .only(
            "id",
            "enabled",
            "unifiedpush_settings__endpoint_url",
            "tenant_id",
            "tenant__suspended",
            "tenant__rate_limit_per_second",
            "tenant__rate_limit_burst",
        )
        .filter(pk=component_id)
        .first()
    )
    if component is None:
        return None
    tenant = component.tenant
    settings = settings_of(component)
    channel = ""
    if conf.current().unifiedpush_direct_seconds > 0:
        channel = link_leases.channel_of(component.pk)
    return Policy(
        component_id=component.pk,
        tenant_id=tenant.pk,
        serves=component.enabled and settings is not None,
        suspended=tenant.suspended,
        # ASCII even for a row saved before URLs were checked: it goes into Location.
        endpoint_url=endpoint_urls.ascii_form(settings.endpoint_url if settings else ""),
        tenant_rate=tenant.rate_limit_per_second,
        tenant_burst=float(tenant.rate_limit_burst) if tenant.rate_limit_burst else None,
        channel=channel,
    )


policies = _PolicyCache()
_endpoint_buckets = TokenBuckets(*conf.current().unifiedpush_endpoint_rate)
_tenant_buckets = TokenBuckets(*conf.current().unifiedpush_tenant_rate)


def reset_limits() -> None:
    """Forget every bucket and cached policy (tests, and settings changed at run time)."""
    global _endpoint_buckets, _tenant_buckets
    _endpoint_buckets = TokenBuckets(*conf.current().unifiedpush_endpoint_rate)
    _tenant_buckets = TokenBuckets(*conf.current().unifiedpush_tenant_rate)
    policies.clear()
    _opened.clear()


@dataclass(frozen=True, slots=True)
class _Opened:
    ring: KeyRing
    endpoint: tokens.Endpoint
    endpoint_key: str
    recipient_key: str


# Tokens this process opened lately, with their keyed hashes: an application server POSTs to
# the same endpoint again and again (a chat's notifications), and opening a PASETO token and
# hashing it is a large part of a POST's CPU. Only what authenticated is kept; expiry is
# checked on every POST, revocation is the store's (in its statement), and a changed key list
# is a new ring, so nothing cached outlives the keys that opened it.
_OPENED_MAX = 10_000
_opened: dict[str, _Opened] = {}


def _open(token: str, now: float) -> _Opened:
    ring = keyring()
    cached = _opened.get(token)
    if cached is not None and cached.ring is ring:
        if cached.endpoint.expires <= now:
            raise tokens.InvalidToken("expired")
        return cached
    endpoint = tokens.open_token(token, now=now, ring=ring)
    key = ring.by_kid(endpoint.kid)
    assert key is not None  # the token was opened with it
    opened = _Opened(
        ring,
        endpoint,
        key.keyed_hash(b"endpoint", endpoint.endpoint_id),
        key.keyed_hash(b"recipient", endpoint.jid.encode()),
    )
    if len(_opened) >= _OPENED_MAX:
        _opened.clear()
    _opened[token] = opened
    return opened


def open_endpoint(token: str, *, now: float) -> tuple[tokens.Endpoint, Policy]:
    """The endpoint and its component's policy, or 404 (nothing tells the causes apart)."""
    endpoint, policy, _ = _open_endpoint(token, now=now)
    return endpoint, policy


def _open_endpoint(
    token: str, *, now: float, cached_only: bool = False
) -> tuple[tokens.Endpoint, Policy, _Opened]:
    try:
        opened = _open(token, now)
    except tokens.InvalidToken:
        raise PushRefused(NOT_FOUND, "no such endpoint") from None
    endpoint = opened.endpoint
    try:
        policy = policies.get(endpoint.component_id, cached_only=cached_only)
    except DatabaseError:
        raise PushRefused(503, "storage unavailable", retry_after=5) from None
    if policy is None or not policy.serves:
        raise PushRefused(NOT_FOUND, "no such endpoint")
    return endpoint, policy, opened


def parse_ttl(value: str | None) -> int:
    """RFC 8030 TTL (1*DIGIT, any length), capped; no TTL gets the default."""
    maximum = conf.current().unifiedpush_max_ttl_seconds
    if value is None or value.strip() == "":
        return min(maximum, conf.current().unifiedpush_default_ttl_seconds)
    value = value.strip()
    if not value.isascii() or not value.isdigit():
        raise PushRefused(400, "TTL must be a number of seconds")
    digits = value.lstrip("0") or "0"
    if len(digits) > len(str(maximum)):  # longer than the cap: no need to read it as a number
        return maximum
    return min(maximum, int(digits))


def parse_topic(value: str | None) -> str:
    """RFC 8030 Topic: at most 32 characters of the base64url alphabet."""
    if value is None or value == "":
        return ""
    if not _TOPIC.fullmatch(value):
        raise PushRefused(400, "Topic must be 1 to 32 characters of the URL-safe base64 alphabet")
    return value


def parse_urgency(value: str | None) -> int:
    if value is None or value.strip() == "":
        return UnifiedPushUrgency.NORMAL
    urgency = _URGENCY.get(value.strip().lower())
    if urgency is None:
        raise PushRefused(400, "Urgency must be very-low, low, normal or high")
    return urgency


def check_length(content_length: int | None) -> None:
    if content_length is not None and content_length > MAX_BODY_BYTES:
        raise PushRefused(413, f"a push message is at most {MAX_BODY_BYTES} bytes")


def _admit(endpoint: tokens.Endpoint, policy: Policy) -> None:
    wait = _endpoint_buckets.take((endpoint.kid, endpoint.endpoint_id))
    if not wait:
        wait = _tenant_buckets.take(
            policy.tenant_id, rate=policy.tenant_rate, burst=policy.tenant_burst
        )
    if wait:
        raise PushRefused(429, "too many messages; slow down", retry_after=max(1, math.ceil(wait)))


def seal_message(endpoint: tokens.Endpoint, body: bytes) -> bytes:
    """Routing and body, sealed together: jid length (2) | jid | application | instance | body."""
    jid = endpoint.jid.encode()
    return keyring().seal(
        struct.pack(">H", len(jid)) + jid + endpoint.application + endpoint.instance + body
    )


@dataclass(frozen=True, slots=True)
class Opened:
    jid: str
    application: bytes
    instance: bytes
    body: bytes


def open_message(sealed: bytes) -> Opened:
    plain = keyring().unseal(sealed)
    (length,) = struct.unpack_from(">H", plain)
    jid_end = 2 + length
    return Opened(
        jid=plain[2:jid_end].decode(),
        application=plain[jid_end : jid_end + 32],
        instance=plain[jid_end + 32 : jid_end + 64],
        body=plain[jid_end + 64 :],
    )


def endpoint_key(endpoint: tokens.Endpoint) -> str:
    key = keyring().by_kid(endpoint.kid)
    assert key is not None  # the token was opened with it
    return key.keyed_hash(b"endpoint", endpoint.endpoint_id)


def recipient_key(endpoint: tokens.Endpoint) -> str:
    key = keyring().by_kid(endpoint.kid)
    assert key is not None
    return key.keyed_hash(b"recipient", endpoint.jid.encode())


def recipient_keys(jid: str) -> list[str]:
    """A phone's keys under every configured key: its messages across a key rotation."""
    return keyring().keyed_hashes(b"recipient", jid.encode())


def topic_key(endpoint: tokens.Endpoint, topic: str) -> str:
    if not topic:
        return ""
    key = keyring().by_kid(endpoint.kid)
    assert key is not None
    return key.keyed_hash(b"topic", endpoint.endpoint_id + topic.encode())


def message_reference(message_id: int) -> str:
    """An unguessable name for a stored message: its id and a MAC of it."""
    raw = struct.pack(">Q", message_id)
    mac = keyring().current.keyed_hash(b"message", raw)[:24]
    return base64.urlsafe_b64encode(raw).decode().rstrip("=") + "." + mac


def message_id_of(reference: str) -> int | None:
    encoded, _, mac = reference.partition(".")
    if len(encoded) != 11 or len(mac) != 24:
        return None
    try:
        raw = base64.urlsafe_b64decode(encoded + "=")
    except (binascii.Error, ValueError):
        return None
    if len(raw) != 8:
        return None
    for key in keyring().keys:
        if hmac.compare_digest(key.keyed_hash(b"message", raw)[:24], mac):
            return int(struct.unpack(">Q", raw)[0])
    return None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A POST checked, admitted and sealed: what remains is to hand it over or store it."""

    message: store.NewMessage
    policy: Policy
    ttl: int
    urgency: int


def prepare(
    *,
    token: str,
    body: bytes,
    ttl: str | None,
    topic: str | None,
    urgency: str | None,
    now: float | None = None,
    cached_only: bool = False,
) -> Prepared:
    """Check a POST (the caller read at most 4097 bytes) and seal its message: PushRefused
    for a refusal; with `cached_only`, ColdCache instead of reading the database."""
    now = time.time() if now is None else now
    endpoint, policy, opened = _open_endpoint(token, now=now, cached_only=cached_only)
    if len(body) > MAX_BODY_BYTES:
        raise PushRefused(413, f"a push message is at most {MAX_BODY_BYTES} bytes")
    granted = parse_ttl(ttl)
    topic_value = parse_topic(topic)
    urgency_value = parse_urgency(urgency)
    if policy.suspended:
        raise PushRefused(503, "temporarily unavailable", retry_after=60)
    _admit(endpoint, policy)
    return _prepared(
        endpoint,
        policy,
        body,
        ttl=granted,
        topic=topic_value,
        urgency=urgency_value,
        now=now,
        keys=(opened.endpoint_key, opened.recipient_key),
    )


def accept(
    *,
    token: str,
    body: bytes,
    ttl: str | None,
    topic: str | None,
    urgency: str | None,
    now: float | None = None,
) -> Accepted:
    """Deliver or store one message for the endpoint `token` names."""
    prepared = prepare(token=token, body=body, ttl=ttl, topic=topic, urgency=urgency, now=now)
    return settle(prepared, _hand_over(prepared))


def _prepared(
    endpoint: tokens.Endpoint,
    policy: Policy,
    body: bytes,
    *,
    ttl: int,
    topic: str,
    urgency: int,
    now: float,
    keys: tuple[str, str] | None = None,
) -> Prepared:
    """`keys` are the endpoint's and the recipient's keyed hashes, if known."""
    received = datetime.fromtimestamp(now, UTC)
    endpoint_hash, recipient_hash = keys or (endpoint_key(endpoint), recipient_key(endpoint))
    message = store.NewMessage(
        tenant_id=policy.tenant_id,
        component_id=policy.component_id,
        endpoint_key=endpoint_hash,
        recipient_key=recipient_hash,
        topic_key=topic_key(endpoint, topic),
        urgency=urgency,
        received=received,
        expires=received + timedelta(seconds=ttl),
        endpoint_expires=datetime.fromtimestamp(endpoint.expires, UTC),
        size=len(body),
        ttl=ttl,
        sealed=seal_message(endpoint, body),
    )
    return Prepared(message, policy, ttl, urgency)


def direct_address(prepared: Prepared) -> str:
    """Where to offer the message on the direct path, or "" (then it is stored here)."""
    if conf.current().unifiedpush_direct_seconds > 0:
        return prepared.policy.channel
    return ""


def _hand_over(prepared: Prepared) -> channel.Handover | None:
    address = direct_address(prepared)
    if not address:
        return None
    window = conf.current().unifiedpush_direct_seconds
    return channel.hand_over(address, prepared.message, window=window)


def settle(prepared: Prepared, handover: channel.Handover | None) -> Accepted:
    """The answer to a POST once the gateway gave its verdict on the direct path (None: no
    verdict); a message the gateway did not take is stored here (this may wait for the
    database: not in an event loop)."""
    message_id = _verdict_id(handover)
    if message_id is None:
        message_id = _store(prepared)
    return _accepted(prepared, message_id)


def settled_at_once(prepared: Prepared, handover: channel.Handover | None) -> Accepted | None:
    """`settle` when the verdict needs no database (delivered, stored by the gateway, or
    refused); None when the message must still be stored here."""
    message_id = _verdict_id(handover)
    return None if message_id is None else _accepted(prepared, message_id)


def _accepted(prepared: Prepared, message_id: int) -> Accepted:
    location = (
        prepared.policy.endpoint_url.rstrip("/") + MESSAGE_PATH + message_reference(message_id)
    )
    return Accepted(
        message_id=message_id,
        location=location,
        ttl=prepared.ttl,
        urgency=UnifiedPushUrgency(prepared.urgency).label,
    )


# Ids of messages that ended on the direct path (never stored): their Location must name a
# message resource, which DELETE then finds gone (404). Above any id the table's sequence
# hands out, so it never names a stored message.
_DIRECT_IDS = 1 << 62


def _verdict_id(handover: channel.Handover | None) -> int | None:
    """The message's id by the gateway's verdict; None when it is still to be stored."""
    if handover is None:
        return None
    if handover.verdict in (channel.DELIVERED, channel.EXPIRED):
        return _DIRECT_IDS + secrets.randbelow(_DIRECT_IDS)
    if handover.verdict == channel.STORED and handover.message_id is not None:
        return handover.message_id
    if handover.verdict == channel.REVOKED:
        raise PushRefused(NOT_FOUND, "no such endpoint")
    return None


def _store(prepared: Prepared) -> int:
    try:
        message_id = store.store(
            prepared.message,
            max_per_endpoint=conf.current().unifiedpush_max_stored_per_endpoint,
        )
    except DatabaseError:
        raise PushRefused(503, "storage unavailable", retry_after=5) from None
    if message_id is None:
        raise PushRefused(NOT_FOUND, "no such endpoint")
    return message_id


def discover(*, token: str, now: float | None = None) -> None:
    """GET on an endpoint: 404 unless it is a live endpoint, as a POST would answer (a
    revoked endpoint too, which only the database knows)."""
    now = time.time() if now is None else now
    _, _, opened = _open_endpoint(token, now=now)
    try:
        revoked = store.is_revoked(opened.endpoint_key, now=datetime.fromtimestamp(now, UTC))
    except DatabaseError:
        raise PushRefused(503, "storage unavailable", retry_after=5) from None
    if revoked:
        raise PushRefused(NOT_FOUND, "no such endpoint")


def withdraw(*, reference: str, now: float | None = None) -> None:
    """DELETE on a message resource: 404 when unknown, already delivered or ended."""
    message_id = message_id_of(reference)
    if message_id is None:
        raise PushRefused(NOT_FOUND, "no such message")
    moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    try:
        withdrawn = store.withdraw(message_id=message_id, now=moment)
    except DatabaseError:
        raise PushRefused(503, "storage unavailable", retry_after=5) from None
    if not withdrawn:
        raise PushRefused(NOT_FOUND, "no such message")
