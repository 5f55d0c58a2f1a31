"""The relay's configuration as one typed, frozen object, read instead of string keys.

pushsite/settings.py stays the one place that reads the environment and holds every default;
this module only types what it built, so a reader cannot carry a default of its own that
differs from it. `current()` is rebuilt whenever a setting changes (tests' override_settings).
Cross-setting rules are system checks (relay/checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

# "count/seconds": a bucket of `count` that refills over `seconds` (a count of 0: no limit).
CountPerSeconds = tuple[int, float]
# "rate/burst": a token bucket refilled at `rate` per second holding `burst` (rate 0: none).
RateBurst = tuple[float, float]


@dataclass(frozen=True, slots=True)
class RelayConf:
    """Everything under settings.RELAY (same names, lower case), plus the relay's top-level
    settings it reads. The comments in pushsite/settings.py say what each one does."""

    # Gateway
    component_poll_seconds: float
    reconnect_min_seconds: float
    reconnect_max_seconds: float
    gateway_threads: int
    max_field_length: int
    max_stanza_bytes: int
    max_stanza_depth: int
    link_max_in_flight: int
    gateway_lease_seconds: float
    gateway_renew_seconds: float
    gateway_name: str
    publish_batch_seconds: float
    publish_batch_max: int
    publish_batch_concurrency: int
    tally_flush_seconds: float
    # Sending
    send_max_attempts: int
    send_retry_base_seconds: float
    send_retry_max_seconds: float
    send_max_age_seconds: float
    provider_timeout_seconds: float
    send_quota_min_seconds: float
    coalesce_seconds: float
    tenant_rate_per_second: float
    tenant_rate_burst: int
    max_in_flight_per_provider: int
    in_flight_wait_seconds: float
    max_threads_per_app: int
    breaker_stalls: int
    breaker_seconds: float
    database_retry_seconds: float
    state_url: str
    # Admin login
    login_max_failures: int
    login_lockout_seconds: int
    trust_x_forwarded_for: bool
    login_max_failures_per_address: str | None
    # WNS defaults for apps that set none
    wns_channel_hosts: tuple[str, ...]
    wns_token_url: str
    # Records
    retention_days: int
    # Windows (UWPX-style) clients
    uwpx_stale_days: float
    uwpx_max_accounts: int
    uwpx_max_body_bytes: int
    uwpx_rate_limit_address: CountPerSeconds
    uwpx_rate_limit_device: CountPerSeconds
    uwpx_rate_limit_test_push: CountPerSeconds
    api_trusted_proxies: int
    # New registrations
    registration_rate_per_domain: CountPerSeconds
    registration_rate_per_tenant: CountPerSeconds
    registration_cap_per_domain: int
    registration_cap_per_tenant: int
    registration_unused_days: float
    # UnifiedPush
    unifiedpush_max_ttl_seconds: int
    unifiedpush_default_ttl_seconds: int
    unifiedpush_max_stored_per_endpoint: int
    unifiedpush_endpoint_rate: RateBurst
    unifiedpush_tenant_rate: RateBurst
    unifiedpush_answer_timeout_seconds: float
    unifiedpush_retry_base_seconds: float
    unifiedpush_retry_max_seconds: float
    unifiedpush_sweep_seconds: float
    unifiedpush_direct_seconds: float
    unifiedpush_channel: str
    # Top-level settings
    var_dir: Path
    credential_keys: tuple[str, ...]
    unifiedpush_keys: tuple[str, ...]
    uwpx_listen_address: str
    uwpx_listen_port: int
    uwpx_listen_app: str
    uwpx_tls_cert_file: str
    uwpx_tls_key_file: str
    # Probes and /metrics (relay/probes.py, relay/metrics.py)
    gateway_probe_listen: str
    worker_probe_listen: str
    metrics_token: str
    # The web process (pushsite/server.py)
    web_bind: str
    web_workers: int
    web_threads: int
    web_max_head_bytes: int
    web_max_headers: int
    web_max_request_line: int
    web_max_body_bytes: int
    web_head_seconds: float
    web_body_seconds: float
    web_flush_seconds: float
    web_graceful_seconds: float
    # The broker's visibility timeout (seconds); None when the broker has none.
    broker_visibility_timeout: float | None


def _count_per_seconds(value: Any) -> CountPerSeconds:
    count, seconds = value
    return int(count), float(seconds)


def _rate_burst(value: Any) -> RateBurst:
    rate, burst = value
    return float(rate), float(burst)


def _optional_text(value: Any) -> str | None:
    return None if value is None else str(value)


def build(source: Any = settings) -> RelayConf:
    """The typed view of `source` (django.conf.settings); raises KeyError for a RELAY key
    pushsite/settings.py does not define."""
    relay = source.RELAY
    options = source.CELERY_BROKER_TRANSPORT_OPTIONS or {}
    visibility = options.get("visibility_timeout")
    return RelayConf(
        component_poll_seconds=float(relay["COMPONENT_POLL_SECONDS"]),
        reconnect_min_seconds=float(relay["RECONNECT_MIN_SECONDS"]),
        reconnect_max_seconds=float(relay["RECONNECT_MAX_SECONDS"]),
        gateway_threads=int(relay["GATEWAY_THREADS"]),
        max_field_length=int(relay["MAX_FIELD_LENGTH"]),
        max_stanza_bytes=int(relay["MAX_STANZA_BYTES"]),
        max_stanza_depth=int(relay["MAX_STANZA_DEPTH"]),
        link_max_in_flight=int(relay["LINK_MAX_IN_FLIGHT"]),
        gateway_lease_seconds=float(relay["GATEWAY_LEASE_SECONDS"]),
        gateway_renew_seconds=float(relay["GATEWAY_RENEW_SECONDS"]),
        gateway_name=str(relay["GATEWAY_NAME"]),
        publish_batch_seconds=float(relay["PUBLISH_BATCH_SECONDS"]),
        publish_batch_max=int(relay["PUBLISH_BATCH_MAX"]),
        publish_batch_concurrency=int(relay["PUBLISH_BATCH_CONCURRENCY"]),
        tally_flush_seconds=float(relay["TALLY_FLUSH_SECONDS"]),
        send_max_attempts=int(relay["SEND_MAX_ATTEMPTS"]),
        send_retry_base_seconds=float(relay["SEND_RETRY_BASE_SECONDS"]),
        send_retry_max_seconds=float(relay["SEND_RETRY_MAX_SECONDS"]),
        send_max_age_seconds=float(relay["SEND_MAX_AGE_SECONDS"]),
        provider_timeout_seconds=float(relay["PROVIDER_TIMEOUT_SECONDS"]),
        send_quota_min_seconds=float(relay["SEND_QUOTA_MIN_SECONDS"]),
        coalesce_seconds=float(relay["COALESCE_SECONDS"]),
        tenant_rate_per_second=float(relay["TENANT_RATE_PER_SECOND"]),
        tenant_rate_burst=int(relay["TENANT_RATE_BURST"]),
        max_in_flight_per_provider=int(relay["MAX_IN_FLIGHT_PER_PROVIDER"]),
        in_flight_wait_seconds=float(relay["IN_FLIGHT_WAIT_SECONDS"]),
        max_threads_per_app=int(relay["MAX_THREADS_PER_APP"]),
        breaker_stalls=int(relay["BREAKER_STALLS"]),
        breaker_seconds=float(relay["BREAKER_SECONDS"]),
        database_retry_seconds=float(relay["DATABASE_RETRY_SECONDS"]),
        state_url=str(relay["STATE_URL"]),
        login_max_failures=int(relay["LOGIN_MAX_FAILURES"]),
        login_lockout_seconds=int(relay["LOGIN_LOCKOUT_SECONDS"]),
        trust_x_forwarded_for=bool(relay["TRUST_X_FORWARDED_FOR"]),
        login_max_failures_per_address=_optional_text(relay["LOGIN_MAX_FAILURES_PER_ADDRESS"]),
        wns_channel_hosts=tuple(relay["WNS_CHANNEL_HOSTS"]),
        wns_token_url=str(relay["WNS_TOKEN_URL"]),
        retention_days=int(relay["RETENTION_DAYS"]),
        uwpx_stale_days=float(relay["UWPX_STALE_DAYS"]),
        uwpx_max_accounts=int(relay["UWPX_MAX_ACCOUNTS"]),
        uwpx_max_body_bytes=int(relay["UWPX_MAX_BODY_BYTES"]),
        uwpx_rate_limit_address=_count_per_seconds(relay["UWPX_RATE_LIMIT_ADDRESS"]),
        uwpx_rate_limit_device=_count_per_seconds(relay["UWPX_RATE_LIMIT_DEVICE"]),
        uwpx_rate_limit_test_push=_count_per_seconds(relay["UWPX_RATE_LIMIT_TEST_PUSH"]),
        api_trusted_proxies=int(relay["API_TRUSTED_PROXIES"]),
        registration_rate_per_domain=_count_per_seconds(relay["REGISTRATION_RATE_PER_DOMAIN"]),
        registration_rate_per_tenant=_count_per_seconds(relay["REGISTRATION_RATE_PER_TENANT"]),
        registration_cap_per_domain=int(relay["REGISTRATION_CAP_PER_DOMAIN"]),
        registration_cap_per_tenant=int(relay["REGISTRATION_CAP_PER_TENANT"]),
        registration_unused_days=float(relay["REGISTRATION_UNUSED_DAYS"]),
        unifiedpush_max_ttl_seconds=int(relay["UNIFIEDPUSH_MAX_TTL_SECONDS"]),
        unifiedpush_default_ttl_seconds=int(relay["UNIFIEDPUSH_DEFAULT_TTL_SECONDS"]),
        unifiedpush_max_stored_per_endpoint=int(relay["UNIFIEDPUSH_MAX_STORED_PER_ENDPOINT"]),
        unifiedpush_endpoint_rate=_rate_burst(relay["UNIFIEDPUSH_ENDPOINT_RATE"]),
        unifiedpush_tenant_rate=_rate_burst(relay["UNIFIEDPUSH_TENANT_RATE"]),
        unifiedpush_answer_timeout_seconds=float(relay["UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS"]),
        unifiedpush_retry_base_seconds=float(relay["UNIFIEDPUSH_RETRY_BASE_SECONDS"]),
        unifiedpush_retry_max_seconds=float(relay["UNIFIEDPUSH_RETRY_MAX_SECONDS"]),
        unifiedpush_sweep_seconds=float(relay["UNIFIEDPUSH_SWEEP_SECONDS"]),
        unifiedpush_direct_seconds=float(relay["UNIFIEDPUSH_DIRECT_SECONDS"]),
        unifiedpush_channel=str(relay["UNIFIEDPUSH_CHANNEL"]),
        var_dir=Path(source.VAR_DIR),
        credential_keys=tuple(source.CREDENTIAL_KEYS or ()),
        unifiedpush_keys=tuple(source.UNIFIEDPUSH_KEYS or ()),
        uwpx_listen_address=str(source.UWPX_LISTEN_ADDRESS),
        uwpx_listen_port=int(source.UWPX_LISTEN_PORT),
        uwpx_listen_app=str(source.UWPX_LISTEN_APP),
        uwpx_tls_cert_file=str(source.UWPX_TLS_CERT_FILE),
        uwpx_tls_key_file=str(source.UWPX_TLS_KEY_FILE),
        gateway_probe_listen=str(source.GATEWAY_PROBE_LISTEN or ""),
        worker_probe_listen=str(source.WORKER_PROBE_LISTEN or ""),
        metrics_token=str(source.METRICS_TOKEN or ""),
        web_bind=str(source.WEB_BIND),
        web_workers=int(source.WEB_WORKERS),
        web_threads=int(source.WEB_THREADS),
        web_max_head_bytes=int(source.WEB_MAX_HEAD_BYTES),
        web_max_headers=int(source.WEB_MAX_HEADERS),
        web_max_request_line=int(source.WEB_MAX_REQUEST_LINE),
        web_max_body_bytes=int(source.WEB_MAX_BODY_BYTES),
        web_head_seconds=float(source.WEB_HEAD_SECONDS),
        web_body_seconds=float(source.WEB_BODY_SECONDS),
        web_flush_seconds=float(source.WEB_FLUSH_SECONDS),
        web_graceful_seconds=float(source.WEB_GRACEFUL_SECONDS),
        broker_visibility_timeout=None if visibility is None else float(visibility),
    )


_current: RelayConf | None = None


def current() -> RelayConf:
    """The configuration now in force (built once, rebuilt after a setting changed)."""
    global _current
    conf = _current
    if conf is None:
        conf = _current = build()
    return conf


def _forget(**_: Any) -> None:
    global _current
    _current = None


setting_changed.connect(_forget, dispatch_uid="relay.conf.forget")
