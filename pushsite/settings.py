"""Settings come from the environment (12-factor); operators manage tenants in the admin.

Without any environment the service runs on embedded defaults: SQLite and a Celery
broker kept in a SQLite file under ``var/``, so ``make run`` needs no server process.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

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
    "relay",
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
]

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
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A send is acknowledged only after it is done: a killed worker loses nothing.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = env_int("CELERY_WORKER_PREFETCH_MULTIPLIER", 4)
CELERY_BROKER_CONNECTION_TIMEOUT = env_float("CELERY_BROKER_CONNECTION_TIMEOUT", 2.0)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # An unacknowledged send comes back after this many seconds; it must exceed the
        # longest retry delay, since delayed sends wait unacknowledged in a worker.
        "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 3600),
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
    # Gateway: threads that talk to the database and the broker for stanza handlers.
    "GATEWAY_THREADS": env_int("RELAY_GATEWAY_THREADS", 8),
    # Largest value of a single form field we accept in a stanza (characters).
    "MAX_FIELD_LENGTH": env_int("RELAY_MAX_FIELD_LENGTH", 4096),
    # Sending: retries with backoff for temporary provider errors.
    "SEND_MAX_ATTEMPTS": env_int("RELAY_SEND_MAX_ATTEMPTS", 8),
    "SEND_RETRY_BASE_SECONDS": env_float("RELAY_SEND_RETRY_BASE_SECONDS", 2.0),
    "SEND_RETRY_MAX_SECONDS": env_float("RELAY_SEND_RETRY_MAX_SECONDS", 300.0),
    # A wake-up older than this is useless: give up instead of retrying.
    "SEND_MAX_AGE_SECONDS": env_float("RELAY_SEND_MAX_AGE_SECONDS", 3600.0),
    # HTTP timeout towards the push providers (seconds).
    "PROVIDER_TIMEOUT_SECONDS": env_float("RELAY_PROVIDER_TIMEOUT_SECONDS", 10.0),
    # Delivery engine (relay/services/delivery.py, throttling.py, providers/limits.py).
    # A quota error (FCM QUOTA_EXCEEDED, HTTP 429) without Retry-After waits at least this.
    "SEND_QUOTA_MIN_SECONDS": env_float("RELAY_SEND_QUOTA_MIN_SECONDS", 60.0),
    # At most one send per registration per window; later publishes fold into one delayed
    # send at the window's end (0 disables coalescing).
    "COALESCE_SECONDS": env_float("RELAY_COALESCE_SECONDS", 2.0),
    # Per-tenant token bucket for publishes, unless the tenant sets its own (0: no limit).
    "TENANT_RATE_PER_SECOND": env_float("RELAY_TENANT_RATE_PER_SECOND", 500.0),
    "TENANT_RATE_BURST": env_int("RELAY_TENANT_RATE_BURST", 5000),
    # Sends in flight per provider in one worker process; excess waits, then retries later.
    "MAX_IN_FLIGHT_PER_PROVIDER": env_int("RELAY_MAX_IN_FLIGHT_PER_PROVIDER", 100),
    # A send a worker already holds waits this long for a slot before it goes back to the
    # broker as retry-later: bouncing at once delayed a tenth of the pushes under load.
    "IN_FLIGHT_WAIT_SECONDS": env_float("RELAY_IN_FLIGHT_WAIT_SECONDS", 30.0),
    # Where coalescing windows and token buckets live, shared by gateways and workers:
    # redis://... (needed when they run on several hosts), or sqlite:///path (one host).
    "STATE_URL": os.environ.get("RELAY_STATE_URL")
    or (
        CELERY_BROKER_URL
        if CELERY_BROKER_URL.startswith(("redis://", "rediss://"))
        else f"sqlite:///{VAR_DIR / 'relay-state.sqlite3'}"
    ),
    # Admin login: refused for LOGIN_LOCKOUT_SECONDS after this many failures for one
    # username (or ten times as many from one address). Behind a trusted proxy, set
    # RELAY_TRUST_X_FORWARDED_FOR=1 so the address is the client's, not the proxy's.
    "LOGIN_MAX_FAILURES": env_int("RELAY_LOGIN_MAX_FAILURES", 5),
    "LOGIN_MAX_FAILURES_PER_ADDRESS": env_int("RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS", 50),
    "LOGIN_LOCKOUT_SECONDS": env_int("RELAY_LOGIN_LOCKOUT_SECONDS", 900),
    "TRUST_X_FORWARDED_FOR": env_bool("RELAY_TRUST_X_FORWARDED_FOR", False),
    # WNS: where channel URIs may point and where tokens come from, unless an app says otherwise.
    "WNS_CHANNEL_HOSTS": env_list("RELAY_WNS_CHANNEL_HOSTS", ["*.notify.windows.com"]),
    "WNS_TOKEN_URL": os.environ.get("RELAY_WNS_TOKEN_URL")
    or "https://login.live.com/accesstoken.srf",
}

def env_rate(name: str, default: str) -> tuple[int, float]:
    """A rate limit written "count/seconds" (e.g. "60/60"); a count of 0 turns it off."""
    count, _, seconds = (os.environ.get(name) or default).partition("/")
    return int(count), float(seconds or 60)


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
# --- UnifiedPush (relay/services/unifiedpush/, README "UnifiedPush").
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
    CACHES = {
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
}

LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "relay.logging.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        # slixmpp logs whole stanzas (JIDs, secrets) even in errors; the gateway logs its own.
        "slixmpp": {"level": "CRITICAL"},
        "celery": {"level": "INFO"},
        # httpx logs whole request URLs at INFO: a WNS channel URI is a device address.
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}
