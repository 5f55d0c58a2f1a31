"""Settings come from the environment (12-factor); operators manage tenants in the admin.

Every variable is declared once in `relay.environment.Environment` (type, default, meaning);
this module reads them once (`ENV`), derives Django's settings from them and keeps the
relay's own, with the defaults that depend on other values resolved, in `RELAY`.

Without any environment the service runs on embedded defaults: SQLite and a Celery
broker kept in a SQLite file under ``var/``, so ``make run`` needs no server process.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from relay.environment import Environment

ENV = Environment()
BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = ENV.var_dir if ENV.given("var_dir") else BASE_DIR / "var"
VAR_DIR.mkdir(parents=True, exist_ok=True)


# "production" turns on every safety the deploy check asks for and refuses defaults.
PRODUCTION = ENV.production
DEBUG = ENV.debug


def _secret_key() -> str:
    if ENV.secret_key:
        return ENV.secret_key
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
    if ENV.credential_keys:
        return list(ENV.credential_keys)
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
    encrypts, all decrypt (rotation: docs/unifiedpush.md, "Keys and their rotation")."""
    if ENV.unifiedpush_keys:
        return list(ENV.unifiedpush_keys)
    if PRODUCTION:
        raise ImproperlyConfigured("UNIFIEDPUSH_KEYS must be set when DEPLOYMENT=production")
    key_file = VAR_DIR / "unifiedpush_key"
    if not key_file.exists():
        import base64

        key_file.write_text(base64.urlsafe_b64encode(secrets.token_bytes(32)).decode())
        key_file.chmod(0o600)
    return [key_file.read_text().strip()]


UNIFIEDPUSH_KEYS = _unifiedpush_keys()
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "[::1]"]
ALLOWED_HOSTS = list(ENV.allowed_hosts) or ([] if PRODUCTION else LOOPBACK_HOSTS)
if PRODUCTION and not ALLOWED_HOSTS:
    # Without it every request would be refused with 400: say so at start instead.
    raise ImproperlyConfigured("ALLOWED_HOSTS must be set when DEPLOYMENT=production")
CSRF_TRUSTED_ORIGINS = list(ENV.csrf_trusted_origins)

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
    # The staff's second factor: TOTP devices and recovery codes (relay/operators).
    "django_otp",
    "django_otp.plugins.otp_totp",
    "django_otp.plugins.otp_static",
    "relay",
    # Feature apps: each plugs into the core (tenancy, the gateway) from its AppConfig.
    "relay.unifiedpush",
    "relay.windows",
    # Second factor, audit trail and session limits of the admin's staff.
    "relay.operators",
    "xmppgateway",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # After authentication: the second step (django-otp), the audit's actor, session limits.
    "django_otp.middleware.OTPMiddleware",
    "relay.operators.middleware.AuditContextMiddleware",
    "relay.operators.middleware.SessionLimitsMiddleware",
    "relay.operators.middleware.SecondFactorMiddleware",
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
        ENV.database_url or f"sqlite:///{VAR_DIR / 'push.sqlite3'}",
        conn_max_age=ENV.database_conn_max_age,
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
STATIC_ROOT = Path(ENV.static_root or VAR_DIR / "static")
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}

# --- Security: production must pass `manage.py check --deploy`.
if PRODUCTION:
    SECURE_SSL_REDIRECT = ENV.secure_ssl_redirect
    # Load balancers probe over plain HTTP: the probes answer there instead of redirecting.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = ENV.secure_hsts_seconds
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_HTTPONLY = True
CSRF_COOKIE_SAMESITE = "Lax"
# An admin session ends with the browser, and after SESSION_COOKIE_AGE at the latest.
SESSION_EXPIRE_AT_BROWSER_CLOSE = ENV.session_expire_at_browser_close
SESSION_COOKIE_AGE = ENV.session_cookie_age
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
DATA_UPLOAD_MAX_MEMORY_SIZE = ENV.data_upload_max_memory_size

# --- Admin login lockout: django-axes reads RELAY's login settings through our adapter.
AXES_HANDLER = "axes.handlers.database.AxesDatabaseHandler"  # shared by every web process
AXES_FAILURE_LIMIT = "relay.services.login_throttle.failure_limit"
AXES_COOLOFF_TIME = "relay.services.login_throttle.cool_off"
AXES_CLIENT_IP_CALLABLE = "relay.services.login_throttle.client_address"
AXES_LOCKOUT_CALLABLE = "relay.admin_site.locked_out"
# A username and an address together: one address (a proxy's) never locks everyone out, and
# guessing a known username from elsewhere never locks its owner out.
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# A password alone does not clear failures: the login is complete, and axes' failures for it
# are cleared, after the second step (relay/operators/services/second_factor.py), which
# counts its own failures here too.
AXES_RESET_ON_SUCCESS = False
# Second-step codes are not kept in axes' record of a failure.
AXES_SENSITIVE_PARAMETERS = ["code", "credential"]
# A lockout lasts LOGIN_LOCKOUT_SECONDS from the failure that caused it, not from the last try.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_DISABLE_ACCESS_LOG = True  # the admin's history is the audit; no table of every login
AXES_ENABLE_ADMIN = False
AXES_VERBOSE = False

# --- The second factor (relay/operators): the name authenticator apps show.
OTP_TOTP_ISSUER = "Push relay"

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
# Production runs RabbitMQ (amqp://, docs/broker.md). The embedded broker (relay/broker.py)
# leases messages, so a killed worker loses nothing; its own file, since kombu's plain
# `sqla+sqlite://` keeps every message it ever handed out as a hidden row, which a lease
# would take as unacknowledged.
CELERY_BROKER_URL = (
    ENV.celery_broker_url or f"sqlrelay+sqlite:///{VAR_DIR / 'relay-broker.sqlite3'}"
)
CELERY_TASK_IGNORE_RESULT = True
# Celery closes every Django connection after each task unless told to reuse them: a new
# database connection per send would be a large part of the worker's time. CONN_MAX_AGE
# still applies.
CELERY_DB_REUSE_MAX = ENV.celery_db_reuse_max
CELERY_RESULT_BACKEND = None
# Workers log through LOGGING (JSON lines) like every other process, not Celery's own format.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A send is acknowledged only after it is done: a killed worker loses nothing.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = ENV.celery_worker_prefetch_multiplier
CELERY_BROKER_CONNECTION_TIMEOUT = ENV.celery_broker_connection_timeout
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A worker that lost the broker reconnects for as long as it takes (Celery's default gives up
# after 100 attempts, about 45 minutes, and the worker exits).
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if CELERY_BROKER_URL.startswith(("amqp://", "amqps://", "pyamqp://")):
    from relay import broker as _broker

    # RabbitMQ (docs/broker.md): one quorum queue, replicated on every node, through a topic
    # exchange (Celery's native delayed delivery needs one for countdowns on quorum queues).
    CELERY_TASK_QUEUES = [_broker.send_queue(ENV)]
    CELERY_TASK_DEFAULT_QUEUE = ENV.celery_queue
    CELERY_TASK_DEFAULT_EXCHANGE = ENV.celery_queue
    CELERY_TASK_DEFAULT_EXCHANGE_TYPE = "topic"
    CELERY_TASK_DEFAULT_ROUTING_KEY = ENV.celery_queue
    CELERY_TASK_DEFAULT_QUEUE_TYPE = "quorum"
    CELERY_TASK_CREATE_MISSING_QUEUES = False
    CELERY_BROKER_NATIVE_DELAYED_DELIVERY_QUEUE_TYPE = "quorum"
    CELERY_WORKER_DETECT_QUORUM_QUEUES = True
    # Every publisher waits for the broker's confirm: a worker's retry or record_outcomes
    # published without one could be lost with the node that took it.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
elif CELERY_BROKER_URL.startswith("sqlrelay+"):
    # An unacknowledged send comes back after this many seconds.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": ENV.celery_visibility_timeout}
# Publishing must fail fast so the gateway can answer `wait` instead of stalling.
CELERY_TASK_PUBLISH_RETRY = True
CELERY_TASK_PUBLISH_RETRY_POLICY = {
    "max_retries": 2,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.5,
}

# --- The relay: every declared variable, with the defaults that depend on others resolved;
# relay.conf.current() types it. Upper-case names, so tests can override a few.
RELAY = {
    name.upper(): value
    for name, value in ENV.model_copy(
        update={
            "var_dir": VAR_DIR,
            "secret_key": SECRET_KEY,
            "credential_keys": tuple(CREDENTIAL_KEYS),
            "unifiedpush_keys": tuple(UNIFIEDPUSH_KEYS),
            "database_url": ENV.database_url or f"sqlite:///{VAR_DIR / 'push.sqlite3'}",
            "celery_broker_url": CELERY_BROKER_URL,
            # Where coalescing windows and token buckets live, shared by gateways and workers.
            "state_url": ENV.state_url or f"sqlite:///{VAR_DIR / 'relay-state.sqlite3'}",
            # On SQLite the sweep is the gateway's only wake-up (no NOTIFY): a short one.
            "unifiedpush_sweep_seconds": ENV.unifiedpush_sweep_seconds
            if ENV.given("unifiedpush_sweep_seconds")
            or not DATABASES["default"]["ENGINE"].endswith("sqlite3")
            else 0.25,
            "reports_at": ENV.reports_at
            if ENV.given("reports_at")
            else ("02:30" if ENV.analytics_database_url else ""),
        }
    )
    .model_dump()
    .items()
}

# --- Cache: the API's rate-limit counters, shared by every web and listener process.
# CACHE_URL=redis://host:6379/1 for several hosts; by default a folder under VAR_DIR.
CACHE_URL = ENV.cache_url
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
# The core's; the feature apps add theirs when beat starts (pushsite/celery.py).
CELERY_BEAT_SCHEDULE = {
    "remove-unused-registrations": {
        "task": "relay.remove_unused_registrations",
        "schedule": ENV.registration_cleanup_seconds,
    },
    # Deferred sends and the broker's dead letters are swept by every worker itself
    # (relay/services/worker_sweeps.py): beat is housekeeping only, no push waits for it.
}


def _beat_time(name: str, value: str) -> tuple[int, int] | None:
    """A daily time "HH:MM" (UTC); empty turns the task off."""
    value = value.strip()
    if not value:
        return None
    try:
        hour, minute = (int(part) for part in value.split(":"))
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be HH:MM (UTC) or empty") from None
    return hour, minute


# The daily Spark reports (analytics/jobs.py, in a process of its own): on by default once a
# read replica is configured (ANALYTICS_DATABASE_URL), at RELAY_REPORTS_AT.
_reports_at = _beat_time("RELAY_REPORTS_AT", RELAY["REPORTS_AT"])
# Pruning what is older than RELAY_RETENTION_DAYS, at RELAY_PRUNE_AT.
_prune_at = _beat_time("RELAY_PRUNE_AT", ENV.prune_at)
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

LOG_LEVEL = ENV.log_level.upper()
# Python's warnings are log lines too (relay.logging.configure).
LOGGING_CONFIG = "relay.logging.configure"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "relay.logging.JsonFormatter"}},
    "filters": {
        "mask_secrets": {"()": "relay.logging.MaskSecrets"},
    },
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
        # The web process's access log (pushsite/server.py: one line per answer, every route)
        # and aiohttp's own lines ("Error handling request …", a parser's refusal quoting the
        # request line); its access lines would repeat ours (the server turns them off too).
        "pushsite.access": {"filters": ["mask_secrets"]},
        "aiohttp.server": {"filters": ["mask_secrets"]},
        "aiohttp.web": {"filters": ["mask_secrets"]},
        "aiohttp.access": {"level": "CRITICAL"},
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
