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
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", [] if PRODUCTION else ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
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
SESSION_COOKIE_AGE = env_int("SESSION_COOKIE_AGE", 8 * 3600)
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("DATA_UPLOAD_MAX_MEMORY_SIZE", 64 * 1024)

# --- Celery: a broker that needs no server process unless CELERY_BROKER_URL says otherwise.
CELERY_BROKER_URL = os.environ.get(
    "CELERY_BROKER_URL", f"sqla+sqlite:///{VAR_DIR / 'celery-broker.sqlite3'}"
)
CELERY_TASK_IGNORE_RESULT = True
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
