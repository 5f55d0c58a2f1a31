"""Settings come from the environment (12-factor); operators manage tenants in the admin.

Without any environment the service runs on embedded defaults: SQLite and a Celery
broker kept in a SQLite file under ``var/``, so ``make run`` needs no server process.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    return float(value) if value.strip() else default


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


# "production" turns on every safety the deploy check asks for and refuses defaults.
PRODUCTION = os.environ.get("DEPLOYMENT", "development").lower() == "production"
DEBUG = env_bool("DEBUG", False)


def _secret_key() -> str:
    key = os.environ.get("SECRET_KEY", "")
    if key:
        return key
    if PRODUCTION:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEPLOYMENT=production")
    key_file = VAR_DIR / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(64))
        key_file.chmod(0o600)
    return key_file.read_text().strip()


SECRET_KEY = _secret_key()


def _credential_keys() -> list[str]:
    """Fernet keys for credentials at rest; the first encrypts, all decrypt (rotation)."""
    keys = env_list("CREDENTIAL_KEYS", [])
    if keys:
        return keys
    if PRODUCTION:
        raise ImproperlyConfigured("CREDENTIAL_KEYS must be set when DEPLOYMENT=production")
    key_file = VAR_DIR / "credential_key"
    if not key_file.exists():
        from cryptography.fernet import Fernet

        key_file.write_text(Fernet.generate_key().decode())
        key_file.chmod(0o600)
    return [key_file.read_text().strip()]


CREDENTIAL_KEYS = _credential_keys()


def _unifiedpush_keys() -> list[str]:
    """32-byte keys (base64url) for UnifiedPush endpoint tokens and stored messages; the first
    encrypts, all decrypt (rotation: README, "UnifiedPush keys")."""
    keys = env_list("UNIFIEDPUSH_KEYS", [])
    if keys:
        return keys
    if PRODUCTION:
        raise ImproperlyConfigured("UNIFIEDPUSH_KEYS must be set when DEPLOYMENT=production")
    key_file = VAR_DIR / "unifiedpush_key"
    if not key_file.exists():
        import base64

        key_file.write_text(base64.urlsafe_b64encode(secrets.token_bytes(32)).decode())
        key_file.chmod(0o600)
    return [key_file.read_text().strip()]


UNIFIEDPUSH_KEYS = _unifiedpush_keys()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", [] if PRODUCTION else ["localhost", "127.0.0.1", "[::1]"])
if PRODUCTION and not ALLOWED_HOSTS:
    # Without it every request would be refused with 400: say so at start instead.
    raise ImproperlyConfigured("ALLOWED_HOSTS must be set when DEPLOYMENT=production")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    # The admin with the relay's site (throttled login, health and usage pages).
    "relay.admin_apps.RelayAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "ninja",  # serves the API docs' assets itself (no CDN)
    "axes",  # admin login lockout (relay/services/login_throttle.py)
    "relay",
    # Feature apps: each plugs into the core (tenancy, the gateway) from its AppConfig.
    "relay.unifiedpush",
    "relay.windows",
    "xmppgateway",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    # Last, as django-axes asks: it turns a locked-out login into the lockout page.
    "axes.middleware.AxesMiddleware",
]

# django-axes checks for a lockout before any password is compared.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# After logging in without an allowed `next`, the admin's index (Django's default,
# /accounts/profile/, does not exist here).
LOGIN_URL = "admin:login"
LOGIN_REDIRECT_URL = "admin:index"

ROOT_URLCONF = "pushsite.urls"
WSGI_APPLICATION = "pushsite.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'push.sqlite3'}"),
        conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 600),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The gateway, the worker and the web process share one file: wait for locks, and WAL
    # lets readers run beside the one writer.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    # Tests run the gateway and worker as processes of their own: they need a file, not memory.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test-push.sqlite3")}
else:
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 5)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", VAR_DIR / "static"))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}

# --- Security: production must pass `manage.py check --deploy`.
if PRODUCTION:
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    # Load balancers probe over plain HTTP: the probes answer there instead of redirecting.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_HTTPONLY = True
CSRF_COOKIE_SAMESITE = "Lax"
# An admin session ends with the browser, and after SESSION_COOKIE_AGE at the latest.
SESSION_EXPIRE_AT_BROWSER_CLOSE = env_bool("SESSION_EXPIRE_AT_BROWSER_CLOSE", True)
SESSION_COOKIE_AGE = env_int("SESSION_COOKIE_AGE", 8 * 3600)
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("DATA_UPLOAD_MAX_MEMORY_SIZE", 64 * 1024)

# --- Admin login lockout: django-axes reads RELAY's login settings through our adapter.
AXES_HANDLER = "axes.handlers.database.AxesDatabaseHandler"  # shared by every web process
AXES_FAILURE_LIMIT = "relay.services.login_throttle.failure_limit"
AXES_COOLOFF_TIME = "relay.services.login_throttle.cool_off"
AXES_CLIENT_IP_CALLABLE = "relay.services.login_throttle.client_address"
AXES_LOCKOUT_CALLABLE = "relay.admin_site.locked_out"
# A username and an address together: one address (a proxy's) never locks everyone out, and
# guessing a known username from elsewhere never locks its owner out.
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# A lockout lasts LOGIN_LOCKOUT_SECONDS from the failure that caused it, not from the last try.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_DISABLE_ACCESS_LOG = True  # the admin's history is the audit; no table of every login
AXES_ENABLE_ADMIN = False
AXES_VERBOSE = False

# --- Content-Security-Policy (django-csp): only this site's own scripts, styles and images.
# Inline style *attributes* (the admin's widgets, our badges and charts) are allowed; inline
# <style> and <script> elements are not.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "style-src-attr": ["'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'none'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}

# --- Celery: a broker that needs no server process unless CELERY_BROKER_URL says otherwise.
# The embedded broker (relay/broker.py) leases messages like Redis does, so a killed worker
# loses nothing; its own file, since kombu's plain `sqla+sqlite://` keeps every message it
# ever handed out as a hidden row, which a lease would take as unacknowledged.
CELERY_BROKER_URL = os.environ.get(
    "CELERY_BROKER_URL", f"sqlrelay+sqlite:///{VAR_DIR / 'relay-broker.sqlite3'}"
)
CELERY_TASK_IGNORE_RESULT = True
# Celery closes every Django connection after each task unless told to reuse them: a new
# database connection per send cost a fifth of the worker's time. CONN_MAX_AGE still applies.
CELERY_DB_REUSE_MAX = env_int("CELERY_DB_REUSE_MAX", 1000)
CELERY_RESULT_BACKEND = None
# Workers log through LOGGING (JSON lines) like every other process, not Celery's own format.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A send is acknowledged only after it is done: a killed worker loses nothing.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = env_int("CELERY_WORKER_PREFETCH_MULTIPLIER", 4)
CELERY_BROKER_CONNECTION_TIMEOUT = env_float("CELERY_BROKER_CONNECTION_TIMEOUT", 2.0)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A worker that lost the broker reconnects for as long as it takes (Celery's default gives up
# after 100 attempts, about 45 minutes, and the worker exits).
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # An unacknowledged send comes back after this many seconds; it must exceed the
        # longest retry delay, since delayed sends wait unacknowledged in a worker.
        "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 3600),
        # A worker renews its lease every few seconds; once it has not for this long (it was
        # killed, or lost the broker), any worker gives back the sends it held
        # (relay/redis_broker.py): a dead worker's sends return after this, not after the
        # visibility timeout.
        "lease_seconds": env_float("CELERY_WORKER_LEASE_SECONDS", 15.0),
        "socket_connect_timeout": 2,
        "socket_timeout": 5,
    }
elif CELERY_BROKER_URL.startswith("sqlrelay+"):
    # Same rule as Redis: an unacknowledged send comes back after this many seconds.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 3600),
    }
# Publishing must fail fast so the gateway can answer `wait` instead of stalling.
CELERY_TASK_PUBLISH_RETRY = True
CELERY_TASK_PUBLISH_RETRY_POLICY = {
    "max_retries": 2,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.5,
}

# --- The relay.
RELAY = {
    # Gateway: how often it looks for added, changed or removed components (seconds).
    "COMPONENT_POLL_SECONDS": env_float("RELAY_COMPONENT_POLL_SECONDS", 3.0),
    # Gateway: reconnect backoff after a lost link (seconds).
    "RECONNECT_MIN_SECONDS": env_float("RELAY_RECONNECT_MIN_SECONDS", 1.0),
    "RECONNECT_MAX_SECONDS": env_float("RELAY_RECONNECT_MAX_SECONDS", 60.0),
    # Gateway: each component link is held by one gateway at a time under a lease in the
    # database (relay/services/link_leases.py, README "Scaling out"): it lasts this long
    # (seconds) and is renewed this often; a gateway that died is replaced after about
    # LEASE + RENEW seconds. RENEW * 2 + 2 must stay below LEASE (system check relay.E104).
    "GATEWAY_LEASE_SECONDS": env_float("RELAY_GATEWAY_LEASE_SECONDS", 10.0),
    "GATEWAY_RENEW_SECONDS": env_float("RELAY_GATEWAY_RENEW_SECONDS", 3.0),
    # Gateway: its name in the admin (the host name by default; the process id and a random
    # suffix are added, so two processes never share one).
    "GATEWAY_NAME": os.environ.get("RELAY_GATEWAY_NAME", ""),
    # Gateway: threads that talk to the database and the broker for stanza handlers.
    "GATEWAY_THREADS": env_int("RELAY_GATEWAY_THREADS", 8),
    # Largest value of a single form field we accept in a stanza (characters).
    "MAX_FIELD_LENGTH": env_int("RELAY_MAX_FIELD_LENGTH", 4096),
    # Gateway: a stanza larger (bytes) or nested deeper than this ends the stream with
    # `policy-violation` (the link reconnects at once). Prosody's own c2s limit is 256 KiB.
    "MAX_STANZA_BYTES": env_int("RELAY_MAX_STANZA_BYTES", 256 * 1024),
    "MAX_STANZA_DEPTH": env_int("RELAY_MAX_STANZA_DEPTH", 32),
    # Gateway: requests one link may have waiting for the database or the broker; beyond it
    # they are answered `wait` (resource-constraint).
    "LINK_MAX_IN_FLIGHT": env_int("RELAY_LINK_MAX_IN_FLIGHT", 1000),
    # Gateway: publishes gathered into one check-and-queue call (and one broker message per
    # app), at most PUBLISH_BATCH_MAX. By default adaptive, without a timer (0 seconds, at most
    # PUBLISH_BATCH_CONCURRENCY calls at once): what arrived while a call ran goes out when it
    # ends. With PUBLISH_BATCH_SECONDS > 0: those arriving within that window of the first
    # (xmppgateway.gateway.PublishBatcher).
    "PUBLISH_BATCH_SECONDS": env_float("RELAY_PUBLISH_BATCH_SECONDS", 0.0),
    "PUBLISH_BATCH_MAX": 100,
    "PUBLISH_BATCH_CONCURRENCY": env_int("RELAY_PUBLISH_BATCH_CONCURRENCY", 1),
    # Gateway: the per-minute publish tallies (reports) are summed in memory and written at
    # most this often (seconds; 0: once per batch), and when the gateway stops. A gateway
    # killed outright loses at most this long of tallies, never a push.
    "TALLY_FLUSH_SECONDS": env_float("RELAY_TALLY_FLUSH_SECONDS", 1.0),
    # Sending: retries with backoff for temporary provider errors.
    "SEND_MAX_ATTEMPTS": env_int("RELAY_SEND_MAX_ATTEMPTS", 8),
    "SEND_RETRY_BASE_SECONDS": env_float("RELAY_SEND_RETRY_BASE_SECONDS", 2.0),
    "SEND_RETRY_MAX_SECONDS": env_float("RELAY_SEND_RETRY_MAX_SECONDS", 300.0),
    # A wake-up older than this is useless: give up instead of retrying.
    "SEND_MAX_AGE_SECONDS": env_float("RELAY_SEND_MAX_AGE_SECONDS", 3600.0),
    # HTTP timeout towards the push providers (seconds): a provider that accepts connections
    # and never answers holds a worker thread this long (docs/faults.md).
    "PROVIDER_TIMEOUT_SECONDS": env_float("RELAY_PROVIDER_TIMEOUT_SECONDS", 5.0),
    # Delivery engine (relay/services/delivery.py, throttling/, provider_limits.py).
    # A quota error (FCM QUOTA_EXCEEDED, HTTP 429) without Retry-After waits at least this.
    "SEND_QUOTA_MIN_SECONDS": env_float("RELAY_SEND_QUOTA_MIN_SECONDS", 60.0),
    # At most one send per registration per window; later publishes fold into one delayed
    # send at the window's end (0 disables coalescing).
    "COALESCE_SECONDS": env_float("RELAY_COALESCE_SECONDS", 2.0),
    # Per-tenant token bucket for publishes, unless the tenant sets its own (0: no limit).
    "TENANT_RATE_PER_SECOND": env_float("RELAY_TENANT_RATE_PER_SECOND", 500.0),
    "TENANT_RATE_BURST": env_int("RELAY_TENANT_RATE_BURST", 5000),
    # Sends in flight per app's provider in one worker process; excess waits, then retries
    # later (relay/services/provider_limits.py).
    "MAX_IN_FLIGHT_PER_PROVIDER": env_int("RELAY_MAX_IN_FLIGHT_PER_PROVIDER", 100),
    # A send a worker already holds waits this long for one of its app's slots before it goes
    # back to the broker as retry-later: bouncing at once delayed a tenth of the pushes under
    # load. Only the app's own threads wait (MAX_THREADS_PER_APP bounds them).
    "IN_FLIGHT_WAIT_SECONDS": env_float("RELAY_IN_FLIGHT_WAIT_SECONDS", 5.0),
    # Bulkheads between tenants: worker threads that may send to one app at once, per worker
    # process; beyond it a send is deferred and tried again shortly. 0: three quarters of the
    # worker's threads (a quarter, at least one, stays free for the other apps).
    "MAX_THREADS_PER_APP": env_int("RELAY_MAX_THREADS_PER_APP", 0),
    # Circuit breaker per app's provider: this many stalls in a row (timeouts, network errors)
    # defer its sends for BREAKER_SECONDS without holding threads, then one probe is sent.
    "BREAKER_STALLS": env_int("RELAY_BREAKER_STALLS", 3),
    "BREAKER_SECONDS": env_float("RELAY_BREAKER_SECONDS", 30.0),
    # A worker retries a database operation on new connections this long (a restart, a
    # failover) before it hands the message back to the broker (docs/faults.md).
    "DATABASE_RETRY_SECONDS": env_float("RELAY_DATABASE_RETRY_SECONDS", 10.0),
    # Where coalescing windows and token buckets live, shared by gateways and workers:
    # redis://... (needed when they run on several hosts), or sqlite:///path (one host).
    "STATE_URL": os.environ.get("RELAY_STATE_URL")
    or (
        CELERY_BROKER_URL
        if CELERY_BROKER_URL.startswith(("redis://", "rediss://"))
        else f"sqlite:///{VAR_DIR / 'relay-state.sqlite3'}"
    ),
    # Admin login (django-axes, see the AXES_ settings): a username is refused from one
    # address for LOGIN_LOCKOUT_SECONDS after this many failures from that address. Behind a
    # trusted proxy, set RELAY_TRUST_X_FORWARDED_FOR=1 so the address is the client's.
    "LOGIN_MAX_FAILURES": env_int("RELAY_LOGIN_MAX_FAILURES", 5),
    "LOGIN_LOCKOUT_SECONDS": env_int("RELAY_LOGIN_LOCKOUT_SECONDS", 900),
    "TRUST_X_FORWARDED_FOR": env_bool("RELAY_TRUST_X_FORWARDED_FOR", False),
    # Retired (a per-address limit locked every admin out behind a proxy): the system check
    # relay.W020 says so while it is still set.
    "LOGIN_MAX_FAILURES_PER_ADDRESS": os.environ.get("RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS"),
    # WNS: where channel URIs may point and where tokens come from, unless an app says otherwise.
    "WNS_CHANNEL_HOSTS": env_list("RELAY_WNS_CHANNEL_HOSTS", ["*.notify.windows.com"]),
    "WNS_TOKEN_URL": os.environ.get("RELAY_WNS_TOKEN_URL")
    or "https://login.live.com/accesstoken.srf",
}


def env_rate(name: str, default: str) -> tuple[int, float]:
    """A rate limit written "count/seconds" (e.g. "60/60"); a count of 0 turns it off."""
    count, _, seconds = (os.environ.get(name) or default).partition("/")
    return int(count), float(seconds or 60)


# --- Reports (analytics/, docs/reports.md): delivery records, registration events and publish
# tallies older than this many days are pruned by `manage.py prune_records` (beat task below).
RELAY["RETENTION_DAYS"] = env_int("RELAY_RETENTION_DAYS", 90)


def env_rate_burst(name: str, default: str) -> tuple[float, float]:
    """A token bucket written "rate/burst" (e.g. "10/100"); a rate of 0 turns it off."""
    rate, _, burst = (os.environ.get(name) or default).partition("/")
    return float(rate), float(burst or rate)


# --- Windows (UWPX-style) clients: the JSON API and the TLS listener (docs/windows-api.md).
RELAY.update(
    {
        # Devices (and their accounts) not updated by their client for this many days are
        # removed by the beat task relay.remove_stale_uwpx_devices (0 keeps them forever).
        "UWPX_STALE_DAYS": env_float("RELAY_UWPX_STALE_DAYS", 45.0),
        "UWPX_MAX_ACCOUNTS": env_int("RELAY_UWPX_MAX_ACCOUNTS", 32),
        "UWPX_MAX_BODY_BYTES": env_int("RELAY_UWPX_MAX_BODY_BYTES", 32 * 1024),
        # Requests per client address, per device id, and test pushes per device id.
        "UWPX_RATE_LIMIT_ADDRESS": env_rate("RELAY_UWPX_RATE_LIMIT_ADDRESS", "120/60"),
        "UWPX_RATE_LIMIT_DEVICE": env_rate("RELAY_UWPX_RATE_LIMIT_DEVICE", "30/60"),
        "UWPX_RATE_LIMIT_TEST_PUSH": env_rate("RELAY_UWPX_RATE_LIMIT_TEST_PUSH", "5/600"),
        # Reverse proxies in front of the web process: the client address is taken from
        # X-Forwarded-For, this many entries from the right (0: the socket's peer address).
        "API_TRUSTED_PROXIES": env_int("RELAY_API_TRUSTED_PROXIES", 0),
    }
)
# --- New registrations by ad-hoc command (relay/services/registrations.py): rate limits
# ("count/seconds": a bucket of `count` that refills over `seconds`; a count of 0 turns it off)
# and caps on registrations kept, per account domain (within a tenant) and per tenant. Beyond
# either the phone is answered `wait` (resource-constraint) and tries again later. A device
# registering again (a new token) is never refused.
RELAY.update(
    {
        "REGISTRATION_RATE_PER_DOMAIN": env_rate("RELAY_REGISTRATION_RATE_PER_DOMAIN", "1000/3600"),
        "REGISTRATION_RATE_PER_TENANT": env_rate(
            "RELAY_REGISTRATION_RATE_PER_TENANT", "10000/3600"
        ),
        "REGISTRATION_CAP_PER_DOMAIN": env_int("RELAY_REGISTRATION_CAP_PER_DOMAIN", 200_000),
        "REGISTRATION_CAP_PER_TENANT": env_int("RELAY_REGISTRATION_CAP_PER_TENANT", 2_000_000),
        # Registrations no publish ever reached this many days after they were last registered
        # are removed by the beat task relay.remove_unused_registrations (0 keeps them).
        "REGISTRATION_UNUSED_DAYS": env_float("RELAY_REGISTRATION_UNUSED_DAYS", 30.0),
    }
)

# --- UnifiedPush (relay/unifiedpush/services/, README "UnifiedPush").
RELAY.update(
    {
        # TTL granted at most, and assumed when a POST sends none (seconds).
        "UNIFIEDPUSH_MAX_TTL_SECONDS": env_int("RELAY_UNIFIEDPUSH_MAX_TTL_SECONDS", 2 * 86400),
        "UNIFIEDPUSH_DEFAULT_TTL_SECONDS": env_int("RELAY_UNIFIEDPUSH_DEFAULT_TTL_SECONDS", 86400),
        # Undelivered messages kept per endpoint; beyond, the oldest least urgent is dropped.
        "UNIFIEDPUSH_MAX_STORED_PER_ENDPOINT": env_int(
            "RELAY_UNIFIEDPUSH_MAX_STORED_PER_ENDPOINT", 100
        ),
        # Token buckets per web process ("rate/burst"): per endpoint, and per tenant unless the
        # tenant sets its own rate; excess POSTs get 429 with Retry-After.
        "UNIFIEDPUSH_ENDPOINT_RATE": env_rate_burst("RELAY_UNIFIEDPUSH_ENDPOINT_RATE", "10/100"),
        "UNIFIEDPUSH_TENANT_RATE": env_rate_burst("RELAY_UNIFIEDPUSH_TENANT_RATE", "1000/10000"),
        # Gateway: how long the phone has to answer a push, and the retry backoff after a
        # temporary error or no answer (seconds).
        "UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS": env_float(
            "RELAY_UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS", 60.0
        ),
        "UNIFIEDPUSH_RETRY_BASE_SECONDS": env_float("RELAY_UNIFIEDPUSH_RETRY_BASE_SECONDS", 5.0),
        "UNIFIEDPUSH_RETRY_MAX_SECONDS": env_float("RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS", 600.0),
        # Gateway: how often it looks for stored messages that are due (the safety net behind
        # PostgreSQL's LISTEN/NOTIFY; on SQLite, the only wake-up, hence shorter there).
        "UNIFIEDPUSH_SWEEP_SECONDS": env_float(
            "RELAY_UNIFIEDPUSH_SWEEP_SECONDS",
            0.25 if DATABASES["default"]["ENGINE"].endswith("sqlite3") else 5.0,
        ),
        # The direct path (docs/unifiedpush.md): how long a POST for an online phone waits for
        # its answer before the gateway stores the message (seconds; 0: every POST is stored
        # first), and where the gateway listens for it (host:port, port 0 picks a free one;
        # "off" turns the listener off). Web processes find it through the gateway's lease.
        "UNIFIEDPUSH_DIRECT_SECONDS": env_float("RELAY_UNIFIEDPUSH_DIRECT_SECONDS", 0.5),
        "UNIFIEDPUSH_CHANNEL": os.environ.get("RELAY_UNIFIEDPUSH_CHANNEL", "127.0.0.1:0"),
    }
)

# The NUL-framed JSON-over-TLS listener that unmodified UWPX clients dial (port 1997).
UWPX_LISTEN_ADDRESS = os.environ.get("UWPX_LISTEN_ADDRESS", "127.0.0.1")
UWPX_LISTEN_PORT = env_int("UWPX_LISTEN_PORT", 1997)
UWPX_LISTEN_APP = os.environ.get("UWPX_LISTEN_APP", "")  # the app's public key
UWPX_TLS_CERT_FILE = os.environ.get("UWPX_TLS_CERT_FILE", "")  # PEM chain
UWPX_TLS_KEY_FILE = os.environ.get("UWPX_TLS_KEY_FILE", "")

# --- Cache: the API's rate-limit counters, shared by every web and listener process.
# CACHE_URL=redis://host:6379/1 for several hosts; by default a folder under VAR_DIR.
CACHE_URL = os.environ.get("CACHE_URL", "")
if CACHE_URL.startswith(("redis://", "rediss://")):
    CACHES: dict[str, dict[str, Any]] = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": CACHE_URL,
            "KEY_PREFIX": "relay",
            "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
        }
    }
else:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(VAR_DIR / "cache"),
            # incr() rewrites an entry with this timeout: longer than any rate-limit window.
            "TIMEOUT": 3600,
            "OPTIONS": {"MAX_ENTRIES": 5000},
        }
    }

# --- Celery beat: periodic housekeeping (`celery -A pushsite beat`, see the Procfile).
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
CELERY_BEAT_SCHEDULE = {
    "remove-stale-uwpx-devices": {
        "task": "relay.remove_stale_uwpx_devices",
        "schedule": env_float("RELAY_UWPX_STALE_CHECK_SECONDS", 6 * 3600.0),
    },
    "remove-unused-registrations": {
        "task": "relay.remove_unused_registrations",
        "schedule": env_float("RELAY_REGISTRATION_CLEANUP_SECONDS", 6 * 3600.0),
    },
}


def _beat_time(name: str, default: str) -> tuple[int, int] | None:
    """A daily time "HH:MM" (UTC) from the environment; empty turns the task off."""
    value = os.environ.get(name, default).strip()
    if not value:
        return None
    try:
        hour, minute = (int(part) for part in value.split(":"))
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be HH:MM (UTC) or empty") from None
    return hour, minute


# The daily Spark reports (analytics/jobs.py, in a process of its own): on by default once a
# read replica is configured (ANALYTICS_DATABASE_URL), at RELAY_REPORTS_AT.
_reports_at = _beat_time(
    "RELAY_REPORTS_AT", "02:30" if os.environ.get("ANALYTICS_DATABASE_URL") else ""
)
# Pruning what is older than RELAY_RETENTION_DAYS, at RELAY_PRUNE_AT.
_prune_at = _beat_time("RELAY_PRUNE_AT", "03:30")
if _reports_at or _prune_at:
    from celery.schedules import crontab

    if _reports_at:
        CELERY_BEAT_SCHEDULE["daily-reports"] = {
            "task": "relay.run_daily_reports",
            "schedule": crontab(hour=_reports_at[0], minute=_reports_at[1]),
        }
    if _prune_at:
        CELERY_BEAT_SCHEDULE["prune-records"] = {
            "task": "relay.prune_records",
            "schedule": crontab(hour=_prune_at[0], minute=_prune_at[1]),
        }

# --- Watching it (README): /metrics and the probes.
# When set, /metrics (web and the probe listeners) answers only `Authorization: Bearer <token>`.
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")
# The gateway's and the worker's listener for /healthz, /readyz and /metrics: host:port (port 0
# picks a free one, logged at start); empty turns it off. Loopback unless told otherwise.
GATEWAY_PROBE_LISTEN = os.environ.get("GATEWAY_PROBE_LISTEN", "127.0.0.1:9101")
WORKER_PROBE_LISTEN = os.environ.get("WORKER_PROBE_LISTEN", "127.0.0.1:9102")

LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "relay.logging.JsonFormatter"}},
    "filters": {"mask_secrets": {"()": "relay.logging.MaskSecrets"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        # Django's own handlers (a plain console when DEBUG, mail to ADMINS, runserver's
        # request lines) are replaced by ours: every line is JSON, and none names a token.
        # INFO as Django sets it: below, SQL with its parameters (secrets) would be logged.
        "django": {"handlers": [], "level": "INFO"},
        # Request lines and "Not Found: <path>", "Method Not Allowed: <path>", "Internal
        # Server Error: <path>": UnifiedPush tokens and message references masked
        # (relay.logging.mask_secrets) before any handler sees them.
        "django.request": {"filters": ["mask_secrets"]},
        "django.server": {"filters": ["mask_secrets"], "level": "INFO", "propagate": True},
        # slixmpp logs whole stanzas (JIDs, secrets) even in errors; the gateway logs its own.
        "slixmpp": {"level": "CRITICAL"},
        "celery": {"level": LOG_LEVEL},
        # Workers log through these handlers (CELERY_WORKER_HIJACK_ROOT_LOGGER off): Celery's
        # per-task lines would carry every job's arguments; delivery.done says what matters.
        "celery.worker.strategy": {"level": "WARNING"},
        "celery.app.trace": {"level": "WARNING"},
        # httpx logs whole request URLs at INFO: a WNS channel URI is a device address.
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}
