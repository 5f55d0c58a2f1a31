"""Every environment variable the service reads, declared once: name, type, default, meaning.

pushsite/settings.py reads them through `Environment` and derives Django's settings and the
relay's (`settings.RELAY`, typed again by `relay.conf.current()`); `.env.example` and the
table in docs/configuration.md are generated from these declarations (`manage.py
environment --write`), and a test keeps them so. A variable some other reader takes (a
command line in the Procfile, a systemd unit, compose.yaml) is declared here too, marked
`read_by`, so that the operator finds every knob in one list.

Empty values count as unset. Lists are comma-separated; rates are written `count/seconds`
(a bucket of `count` refilled over `seconds`) or `rate/burst` (a token bucket).
"""

from __future__ import annotations

import enum
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

KEY_COMMAND = (
    'python3 -c "import base64, os; print(base64.urlsafe_b64encode(os.urandom(32)).decode())"'
)


class Group(enum.StrEnum):
    REQUIRED = "required in production"
    COMPOSE = "docker compose only"
    PROCESSES = "process command lines"
    STORES = "databases and broker"
    FILES = "files and logs"
    SECURITY = "web security"
    GATEWAY = "gateway"
    WORKERS = "workers"
    WINDOWS = "Windows clients (UWPX)"
    REPORTS = "reports for analysts"
    UNIFIEDPUSH = "UnifiedPush"
    WATCHING = "watching it"


def _split(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(item.strip() for item in value.split(",") if item.strip())
    return value


def _pair(value: Any, default_second: float | None = None) -> Any:
    if isinstance(value, str):
        first, _, second = value.partition("/")
        if not second and default_second is None:
            raise ValueError(f"expected two numbers separated by '/', not {value!r}")
        return first, second or default_second
    return value


# "a,b,c"
Names = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_split)]
# "count/seconds": a bucket of `count` refilled over `seconds` (a count of 0: no limit).
CountPerSeconds = Annotated[tuple[int, float], NoDecode, BeforeValidator(lambda v: _pair(v, 60))]
# "rate/burst": a token bucket refilled at `rate` per second holding `burst` (rate 0: none).
RateBurst = Annotated[tuple[float, float], NoDecode, BeforeValidator(_pair)]


def var(
    env: str,
    default: Any,
    doc: str,
    *,
    group: Group,
    shown: str | None = None,
    example: str | None = None,
    read_by: str = "",
) -> Any:
    """One variable. `doc` "" shares the comment of the one declared before it; `shown` is
    the default as the docs say it when it is derived (None: the default itself); `example`
    an example value the docs show instead of the default; `read_by` who reads it if not
    the Python code (the Procfile, the units, compose.yaml)."""
    return Field(
        default,
        validation_alias=env,
        description=doc,
        json_schema_extra={
            "group": group.value,
            "shown": shown,
            "example": example,
            "read_by": read_by,
        },
    )


class Environment(BaseSettings):
    model_config = SettingsConfigDict(
        case_sensitive=True,
        env_ignore_empty=True,
        extra="ignore",
        frozen=True,
        validate_by_name=True,
    )

    # ------------------------------------------------------------ required in production
    deployment: str = var(
        "DEPLOYMENT",
        "development",
        "`production` refuses to start without SECRET_KEY, CREDENTIAL_KEYS, UNIFIEDPUSH_KEYS "
        "and ALLOWED_HOSTS, and turns on HTTPS redirects (not for /healthz, /readyz and "
        "/metrics), HSTS and secure cookies.",
        group=Group.REQUIRED,
        example="production",
    )
    secret_key: str = var(
        "SECRET_KEY",
        "",
        "Django's signing key (sessions, CSRF). Generate one:\n"
        '  python3 -c "import secrets; print(secrets.token_urlsafe(64))"',
        group=Group.REQUIRED,
        shown="generated once into VAR_DIR/secret_key",
        example="",
    )
    credential_keys: Names = var(
        "CREDENTIAL_KEYS",
        (),
        "Fernet keys that encrypt provider credentials at rest, comma-separated: the first "
        "encrypts, all decrypt. Losing them loses every stored credential: back them up. To "
        "rotate: put a new key first, run `manage.py rotate_credentials`, then drop the old "
        "one. Generate one:\n"
        f"  {KEY_COMMAND}",
        group=Group.REQUIRED,
        shown="generated once into VAR_DIR/credential_key",
        example="",
    )
    unifiedpush_keys: Names = var(
        "UNIFIEDPUSH_KEYS",
        (),
        "32-byte keys (base64) for UnifiedPush endpoint tokens, stored messages and keyed "
        "hashes, comma-separated: the first encrypts, all decrypt; the web and gateway "
        "processes need the same list. Losing them breaks every issued endpoint and stored "
        "message. Rotation: docs/unifiedpush.md. Generate one:\n"
        f"  {KEY_COMMAND}",
        group=Group.REQUIRED,
        shown="generated once into VAR_DIR/unifiedpush_key",
        example="",
    )
    allowed_hosts: Names = var(
        "ALLOWED_HOSTS",
        (),
        "Host names the web process answers to, comma-separated (e.g. push.example.org).",
        group=Group.REQUIRED,
        shown="loopback names (none in production)",
        example="",
    )
    csrf_trusted_origins: Names = var(
        "CSRF_TRUSTED_ORIGINS",
        (),
        "Origins allowed to post the admin's forms, comma-separated, with the scheme (e.g. "
        "https://push.example.org). Needed when the admin is reached through a proxy on https.",
        group=Group.REQUIRED,
        example="",
    )

    # ------------------------------------------------------------ docker compose only
    postgres_password: str = var(
        "POSTGRES_PASSWORD",
        "",
        "PostgreSQL's password; compose.yaml builds DATABASE_URL, CELERY_BROKER_URL, "
        "RELAY_STATE_URL and CACHE_URL from its own services, so those below are for systemd "
        "(or any host without compose).",
        group=Group.COMPOSE,
        example="",
        read_by="compose.yaml",
    )
    rabbitmq_password: str = var(
        "RABBITMQ_PASSWORD",
        "",
        "The password of the relay's RabbitMQ user (`relay`) in compose.yaml's cluster.",
        group=Group.COMPOSE,
        example="",
        read_by="compose.yaml",
    )
    rabbitmq_erlang_cookie: str = var(
        "RABBITMQ_ERLANG_COOKIE",
        "",
        "The secret the three RabbitMQ nodes share to form one cluster (any long random "
        "string, e.g. `openssl rand -hex 32`).",
        group=Group.COMPOSE,
        example="",
        read_by="compose.yaml",
    )
    relay_image: str = var(
        "RELAY_IMAGE",
        "push-relay:latest",
        "The image to run (built from the Dockerfile when missing).",
        group=Group.COMPOSE,
        read_by="compose.yaml",
    )
    relay_config_dir: str = var(
        "RELAY_CONFIG_DIR",
        "./config",
        "Host folder mounted read-only at /etc/push-relay: tenants.yaml, credential files, "
        "certificates.",
        group=Group.COMPOSE,
        read_by="compose.yaml",
    )
    web_publish: str = var(
        "WEB_PUBLISH",
        "127.0.0.1:8000",
        "Where the web port (8000) is published; loopback for a reverse proxy on the same host.",
        group=Group.COMPOSE,
        read_by="compose.yaml",
    )
    uwpx_publish: str = var(
        "UWPX_PUBLISH",
        "1997",
        "Where the UWPX listener's port (1997) is published.",
        group=Group.COMPOSE,
        read_by="compose.yaml",
    )

    # ------------------------------------------------------------ process command lines
    web_bind: str = var(
        "WEB_BIND",
        "127.0.0.1:8000",
        "The web process's address (`python -m pushsite.server`, docs/web.md; in the "
        "container it is always 0.0.0.0:8000).",
        group=Group.PROCESSES,
    )
    web_workers: int = var(
        "WEB_WORKERS",
        1,
        "The web process's worker processes (each an event loop), and the threads of each "
        "(Django, and the UnifiedPush resource's database work): concurrent UnifiedPush POSTs "
        "of one worker share a commit and a connection to the gateway, so one worker per core "
        "is enough.",
        group=Group.PROCESSES,
    )
    web_threads: int = var("WEB_THREADS", 16, "", group=Group.PROCESSES)
    web_max_head_bytes: int = var(
        "WEB_MAX_HEAD_BYTES",
        16384,
        "What one request to the web process may be (docs/web.md): its head's bytes (431), "
        "its header fields (431), its request line (414), each answered, then the connection "
        "closed; its body (a longer one: 400 with Connection: close).",
        group=Group.PROCESSES,
    )
    web_max_headers: int = var("WEB_MAX_HEADERS", 100, "", group=Group.PROCESSES)
    web_max_request_line: int = var("WEB_MAX_REQUEST_LINE", 8190, "", group=Group.PROCESSES)
    web_max_body_bytes: int = var("WEB_MAX_BODY_BYTES", 1024 * 1024, "", group=Group.PROCESSES)
    web_head_seconds: float = var(
        "WEB_HEAD_SECONDS",
        75.0,
        "Deadlines of the web process, in seconds: a request's head whole within "
        "WEB_HEAD_SECONDS of when it began waiting for it (the keep-alive timeout too: keep it "
        "above the reverse proxy's), its body within WEB_BODY_SECONDS, each answer taken by "
        "the socket within WEB_FLUSH_SECONDS (else the connection is closed hard, so a client "
        "that stops reading holds nothing); a stopping worker answers what it holds for "
        "WEB_GRACEFUL_SECONDS.",
        group=Group.PROCESSES,
    )
    web_body_seconds: float = var("WEB_BODY_SECONDS", 30.0, "", group=Group.PROCESSES)
    web_flush_seconds: float = var("WEB_FLUSH_SECONDS", 10.0, "", group=Group.PROCESSES)
    web_graceful_seconds: float = var("WEB_GRACEFUL_SECONDS", 25.0, "", group=Group.PROCESSES)
    web_max_connections: int = var(
        "WEB_MAX_CONNECTIONS",
        1000,
        "Connections one web worker keeps open (docs/web.md): at the cap the one that has "
        "waited longest for a request is closed, or, when every one is being answered, a new "
        "one is refused (503). Kept below the open-file limit (LimitNOFILE) less 128 for the "
        "worker's other files.",
        group=Group.PROCESSES,
    )
    worker_concurrency: int = var(
        "WORKER_CONCURRENCY",
        16,
        "Threads of one Celery worker process (the sends it has in flight at once).",
        group=Group.PROCESSES,
        read_by="Procfile, systemd",
    )

    # ------------------------------------------------------------ databases and broker
    database_url: str = var(
        "DATABASE_URL",
        "",
        "The database. systemd: postgres://relay:PASSWORD@db.internal:5432/relay",
        group=Group.STORES,
        shown="sqlite:///VAR_DIR/push.sqlite3",
    )
    database_conn_max_age: int = var(
        "DATABASE_CONN_MAX_AGE", 600, "Seconds a database connection is kept open.",
        group=Group.STORES,
    )  # fmt: skip
    celery_broker_url: str = var(
        "CELERY_BROKER_URL",
        "",
        "The Celery broker: RabbitMQ in production, every node of the cluster `;`-separated "
        "(amqp://relay:PASSWORD@rabbit1.internal:5672//;amqp://relay:PASSWORD@rabbit2.internal"
        ":5672//; docs/broker.md); the default is a SQLite file that only processes on one "
        "host can share.",
        group=Group.STORES,
        shown="sqlrelay+sqlite:///VAR_DIR/relay-broker.sqlite3",
    )
    celery_queue: str = var(
        "CELERY_QUEUE",
        "relay.sends",
        "RabbitMQ: the quorum queue (and topic exchange) the send tasks travel through; its "
        "dead letters go to `<name>.dead`.",
        group=Group.STORES,
    )
    celery_delivery_limit: int = var(
        "CELERY_DELIVERY_LIMIT",
        20,
        "RabbitMQ: deliveries of one send (a worker killed while holding it counts) before "
        "the queue dead-letters it to `<queue>.dead`, from where the workers record it in "
        "the dead letters (never dropped).",
        group=Group.STORES,
    )
    celery_confirm_timeout: float = var(
        "CELERY_CONFIRM_TIMEOUT",
        2.0,
        "RabbitMQ: seconds the gateway waits for the broker to confirm a publish (connecting "
        "included) before it answers `wait`.",
        group=Group.STORES,
    )
    celery_visibility_timeout: int = var(
        "CELERY_VISIBILITY_TIMEOUT",
        3600,
        "The SQLite broker: seconds before a send left unacknowledged by a dead worker is "
        "delivered again; must exceed the longest retry delay (RELAY_SEND_RETRY_MAX_SECONDS).",
        group=Group.STORES,
    )
    celery_db_reuse_max: int = var(
        "CELERY_DB_REUSE_MAX",
        1000,
        "Tasks before a worker recycles its database connections.",
        group=Group.STORES,
    )
    celery_worker_prefetch_multiplier: int = var(
        "CELERY_WORKER_PREFETCH_MULTIPLIER",
        4,
        "Messages a worker process reserves ahead, per thread.",
        group=Group.STORES,
    )
    celery_broker_connection_timeout: float = var(
        "CELERY_BROKER_CONNECTION_TIMEOUT",
        2.0,
        "Seconds to wait for the broker before a publish is answered with a `wait` error.",
        group=Group.STORES,
    )
    cache_url: str = var(
        "CACHE_URL",
        "",
        "The API's rate-limit counters, shared by web processes: redis://redis.internal:6379/1 "
        "when there are several.",
        group=Group.STORES,
        shown="a folder under VAR_DIR",
    )
    state_url: str = var(
        "RELAY_STATE_URL",
        "",
        "Coalescing windows and tenant token buckets, shared by gateways and workers: "
        "redis://redis.internal:6379/2 when they run on several hosts, or sqlite:///path (one "
        "host). Losing it loses no push (the broker holds them).",
        group=Group.STORES,
        shown="a SQLite file under VAR_DIR",
    )

    # ------------------------------------------------------------ files and logs
    var_dir: Path = var(
        "VAR_DIR",
        Path("var"),
        "Local state: the beat schedule, SQLite files and generated keys of a development "
        "setup. The systemd units and the image set /var/lib/push-relay; keep it so (the "
        "units may write only there).",
        group=Group.FILES,
        shown="./var",
    )
    static_root: str = var(
        "STATIC_ROOT",
        "",
        "Where collectstatic puts the admin's assets (served by the web process itself).",
        group=Group.FILES,
        shown="VAR_DIR/static",
    )
    log_level: str = var(
        "LOG_LEVEL",
        "INFO",
        "DEBUG, INFO, WARNING or ERROR; logs are JSON lines on stderr.",
        group=Group.FILES,
    )
    debug: bool = var("DEBUG", False, "Django debug mode: never in production.", group=Group.FILES)

    # ------------------------------------------------------------ web security
    secure_ssl_redirect: bool = var(
        "SECURE_SSL_REDIRECT",
        True,
        "Redirect plain http to https (production only; the probes excepted); needs "
        "X-Forwarded-Proto from the proxy.",
        group=Group.SECURITY,
    )
    secure_hsts_seconds: int = var(
        "SECURE_HSTS_SECONDS", 31536000, "HSTS max-age in seconds (production only).",
        group=Group.SECURITY,
    )  # fmt: skip
    session_expire_at_browser_close: bool = var(
        "SESSION_EXPIRE_AT_BROWSER_CLOSE",
        True,
        "An admin session ends when the browser closes, and after SESSION_COOKIE_AGE seconds "
        "anyway.",
        group=Group.SECURITY,
    )
    session_cookie_age: int = var("SESSION_COOKIE_AGE", 8 * 3600, "", group=Group.SECURITY)
    admin_idle_seconds: int = var(
        "RELAY_ADMIN_IDLE_SECONDS",
        1800,
        "An admin session ends after this many seconds without a request, and after "
        "RELAY_ADMIN_SESSION_MAX_SECONDS from its login whatever its use.",
        group=Group.SECURITY,
    )
    admin_session_max_seconds: int = var(
        "RELAY_ADMIN_SESSION_MAX_SECONDS", 8 * 3600, "", group=Group.SECURITY
    )
    data_upload_max_memory_size: int = var(
        "DATA_UPLOAD_MAX_MEMORY_SIZE",
        64 * 1024,
        "Largest request body Django reads into memory (bytes).",
        group=Group.SECURITY,
    )
    login_max_failures: int = var(
        "RELAY_LOGIN_MAX_FAILURES",
        5,
        "Admin login lockout: a username is refused from one address after this many "
        "failures, for this many seconds (kept in the database: every web process agrees).",
        group=Group.SECURITY,
    )
    login_lockout_seconds: int = var("RELAY_LOGIN_LOCKOUT_SECONDS", 900, "", group=Group.SECURITY)
    trust_x_forwarded_for: bool = var(
        "RELAY_TRUST_X_FORWARDED_FOR",
        False,
        "Behind one reverse proxy that appends X-Forwarded-For: the login counts the "
        "client's address.",
        group=Group.SECURITY,
    )
    login_max_failures_per_address: str | None = var(
        "RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS",
        None,
        "Retired (one proxy's address locked every admin out): leave unset; `manage.py check` "
        "warns.",
        group=Group.SECURITY,
        shown="",
    )
    api_trusted_proxies: int = var(
        "RELAY_API_TRUSTED_PROXIES",
        0,
        "Reverse proxies in front of the web process: the Windows API takes the client "
        "address from X-Forwarded-For, this many entries from the right (0: the socket's peer).",
        group=Group.SECURITY,
    )

    # ------------------------------------------------------------ gateway
    component_poll_seconds: float = var(
        "RELAY_COMPONENT_POLL_SECONDS",
        3.0,
        "Seconds between looks for added, changed or removed components.",
        group=Group.GATEWAY,
    )
    reconnect_min_seconds: float = var(
        "RELAY_RECONNECT_MIN_SECONDS",
        1.0,
        "Reconnect backoff of a lost link (seconds): a link that was up comes back after the "
        "minimum however often it dropped; the delay doubles only while connecting fails.",
        group=Group.GATEWAY,
    )
    reconnect_max_seconds: float = var("RELAY_RECONNECT_MAX_SECONDS", 60.0, "", group=Group.GATEWAY)
    gateway_threads: int = var(
        "RELAY_GATEWAY_THREADS",
        8,
        "Threads for the gateway's database and broker calls.",
        group=Group.GATEWAY,
    )
    publish_batch_seconds: float = var(
        "RELAY_PUBLISH_BATCH_SECONDS",
        0.0,
        "How the gateway gathers publishes into one database query and one broker message. "
        "Adaptive (0 seconds, 1 batch call at a time): a publish goes out at once when no "
        "batch call runs, and the publishes that arrive meanwhile go out together when it "
        "ends. A window of N seconds instead gathers what arrives within N seconds of the "
        "first (0 calls: no limit).",
        group=Group.GATEWAY,
    )
    publish_batch_concurrency: int = var(
        "RELAY_PUBLISH_BATCH_CONCURRENCY", 1, "", group=Group.GATEWAY
    )
    publish_batch_max: int = var(
        "RELAY_PUBLISH_BATCH_MAX",
        100,
        "Publishes in one batch at most.",
        group=Group.GATEWAY,
    )
    direct_send_share: float = var(
        "RELAY_DIRECT_SEND_SHARE",
        0.5,
        "The gateway sends an everyday push itself, without the broker and a worker, while its "
        "own CPU over the last half second stays under this share of a core; above it, and for "
        "retries, sends go through the broker. 0: every send goes through the broker.",
        group=Group.GATEWAY,
    )
    direct_sends_in_flight: int = var(
        "RELAY_DIRECT_SENDS_IN_FLIGHT",
        8,
        "Batches one gateway sends itself at once (each in a thread of its own); one app holds "
        "at most half of them, and none once its oldest is slow.",
        group=Group.GATEWAY,
    )
    delivery_journal_seconds: float = var(
        "RELAY_DELIVERY_JOURNAL_SECONDS",
        0.1,
        "What the gateway's own sends taught (their Delivery rows) is appended to a journal "
        "under VAR_DIR before the publish is answered and written to the database this often "
        "(seconds), many pushes in one statement; a journal whose gateway died is written by "
        "the next gateway on the host. VAR_DIR must outlive the process (a volume). 0: each "
        "batch's rows are written before its answer.",
        group=Group.GATEWAY,
    )
    tally_flush_seconds: float = var(
        "RELAY_TALLY_FLUSH_SECONDS",
        1.0,
        "The publish tallies of the reports are summed in memory and written at most this "
        "often (seconds; 0: once per batch); a gateway killed outright loses at most that "
        "long of them, never a push.",
        group=Group.GATEWAY,
    )
    gateway_lease_seconds: float = var(
        "RELAY_GATEWAY_LEASE_SECONDS",
        10.0,
        "Several gateways may run (docs/production.md, Scaling out): each link is held by one "
        "of them under a lease in the database that lasts this long (seconds) and is renewed "
        "this often; a dead gateway's links move after about LEASE + RENEW seconds. "
        "RENEW * 2 + 2 must stay below LEASE (relay.E107).",
        group=Group.GATEWAY,
    )
    gateway_renew_seconds: float = var("RELAY_GATEWAY_RENEW_SECONDS", 3.0, "", group=Group.GATEWAY)
    gateway_name: str = var(
        "RELAY_GATEWAY_NAME",
        "",
        "The gateway's name in the admin (pid and a random tag are added).",
        group=Group.GATEWAY,
        shown="the host name",
    )
    max_field_length: int = var(
        "RELAY_MAX_FIELD_LENGTH",
        4096,
        "Longest form field value accepted in a stanza (characters).",
        group=Group.GATEWAY,
    )
    max_stanza_bytes: int = var(
        "RELAY_MAX_STANZA_BYTES",
        256 * 1024,
        "Largest stanza (bytes) and deepest nesting accepted on a component link; beyond "
        "either the stream is closed with policy-violation before the stanza is read whole.",
        group=Group.GATEWAY,
    )
    max_stanza_depth: int = var("RELAY_MAX_STANZA_DEPTH", 32, "", group=Group.GATEWAY)
    link_max_in_flight: int = var(
        "RELAY_LINK_MAX_IN_FLIGHT",
        1000,
        "Requests one link may have waiting for the database or broker; beyond: "
        "wait/resource-constraint.",
        group=Group.GATEWAY,
    )
    registration_rate_per_domain: CountPerSeconds = var(
        "RELAY_REGISTRATION_RATE_PER_DOMAIN",
        (1000, 3600.0),
        "New registrations (ad-hoc register commands) per account domain and per tenant, "
        "written count/seconds; beyond: wait/resource-constraint. Re-registrations always "
        "pass.",
        group=Group.GATEWAY,
        shown="1000/3600",
    )
    registration_rate_per_tenant: CountPerSeconds = var(
        "RELAY_REGISTRATION_RATE_PER_TENANT",
        (10000, 3600.0),
        "",
        group=Group.GATEWAY,
        shown="10000/3600",
    )
    registration_cap_per_domain: int = var(
        "RELAY_REGISTRATION_CAP_PER_DOMAIN",
        200_000,
        "Most registrations one account domain / one tenant may hold (0: no cap).",
        group=Group.GATEWAY,
    )
    registration_cap_per_tenant: int = var(
        "RELAY_REGISTRATION_CAP_PER_TENANT", 2_000_000, "", group=Group.GATEWAY
    )
    registration_unused_days: float = var(
        "RELAY_REGISTRATION_UNUSED_DAYS",
        30.0,
        "Registrations never pushed to this many days after their last registration are "
        "removed (beat task relay.remove_unused_registrations, every "
        "RELAY_REGISTRATION_CLEANUP_SECONDS; 0 keeps them).",
        group=Group.GATEWAY,
    )
    registration_cleanup_seconds: float = var(
        "RELAY_REGISTRATION_CLEANUP_SECONDS", 6 * 3600.0, "", group=Group.GATEWAY
    )
    tenant_rate_per_second: float = var(
        "RELAY_TENANT_RATE_PER_SECOND",
        500.0,
        "Default token bucket per tenant for publishes (a tenant's own setting wins; 0: no limit).",
        group=Group.GATEWAY,
    )
    tenant_rate_burst: int = var("RELAY_TENANT_RATE_BURST", 5000, "", group=Group.GATEWAY)
    coalesce_seconds: float = var(
        "RELAY_COALESCE_SECONDS",
        2.0,
        "At most one send per registration in this many seconds (0 disables coalescing).",
        group=Group.GATEWAY,
    )

    # ------------------------------------------------------------ workers
    send_max_attempts: int = var(
        "RELAY_SEND_MAX_ATTEMPTS",
        8,
        "A send is retried until either runs out, then it becomes a dead letter.",
        group=Group.WORKERS,
    )
    send_max_age_seconds: float = var("RELAY_SEND_MAX_AGE_SECONDS", 3600.0, "", group=Group.WORKERS)
    send_retry_base_seconds: float = var(
        "RELAY_SEND_RETRY_BASE_SECONDS",
        2.0,
        "Exponential backoff with jitter between retries (seconds); Retry-After is honoured.",
        group=Group.WORKERS,
    )
    send_retry_max_seconds: float = var(
        "RELAY_SEND_RETRY_MAX_SECONDS", 300.0, "", group=Group.WORKERS
    )
    send_quota_min_seconds: float = var(
        "RELAY_SEND_QUOTA_MIN_SECONDS",
        60.0,
        "A quota error without Retry-After waits at least this long (seconds).",
        group=Group.WORKERS,
    )
    provider_timeout_seconds: float = var(
        "RELAY_PROVIDER_TIMEOUT_SECONDS",
        5.0,
        "HTTP timeout towards FCM, APNs and WNS (seconds): how long a provider that never "
        "answers holds a worker thread.",
        group=Group.WORKERS,
    )
    max_in_flight_per_provider: int = var(
        "RELAY_MAX_IN_FLIGHT_PER_PROVIDER",
        100,
        "Sends in flight per app's provider and worker process, and how long a send waits for "
        "a slot (seconds) before it is retried later.",
        group=Group.WORKERS,
    )
    in_flight_wait_seconds: float = var(
        "RELAY_IN_FLIGHT_WAIT_SECONDS", 5.0, "", group=Group.WORKERS
    )
    max_threads_per_app: int = var(
        "RELAY_MAX_THREADS_PER_APP",
        0,
        "Worker threads one app may send on at once (0: three quarters of the worker's "
        "threads), so one tenant's stuck provider cannot take the pool; beyond it a send waits "
        "for one of its app's threads while no other app's message waits, else is deferred.",
        group=Group.WORKERS,
    )
    deferred_sweep_seconds: float = var(
        "RELAY_DEFERRED_SWEEP_SECONDS",
        1.0,
        "Deferred sends (retries, rate limits, coalescing windows) wait in the database; each "
        "worker publishes at most RELAY_DEFERRED_SWEEP_BATCH due ones every this many seconds, "
        "shared between tenants, so a provider's backlog never floods the queue of fresh pushes.",
        group=Group.WORKERS,
    )
    deferred_sweep_batch: int = var("RELAY_DEFERRED_SWEEP_BATCH", 200, "", group=Group.WORKERS)
    deferred_queue_limit: int = var(
        "RELAY_DEFERRED_QUEUE_LIMIT",
        20,
        "While more messages than this wait in the broker's send queue, a sweep publishes "
        "only a few sends overdue by more than 30 s: fresh pushes go first, the deferred ones "
        "follow once the workers catch up, and a queue that stays busy never starves them "
        "(0: no limit).",
        group=Group.WORKERS,
    )
    breaker_stalls: int = var(
        "RELAY_BREAKER_STALLS",
        3,
        "A provider that timed out RELAY_BREAKER_STALLS times in a row gets no sends for "
        "RELAY_BREAKER_SECONDS (deferred, then one probe).",
        group=Group.WORKERS,
    )
    breaker_seconds: float = var("RELAY_BREAKER_SECONDS", 30.0, "", group=Group.WORKERS)
    database_retry_seconds: float = var(
        "RELAY_DATABASE_RETRY_SECONDS",
        10.0,
        "How long a worker retries a database step on new connections before the message (or "
        "the bookkeeping of sends already made) goes back to the broker (seconds).",
        group=Group.WORKERS,
    )
    wns_channel_hosts: Names = var(
        "RELAY_WNS_CHANNEL_HOSTS",
        ("*.notify.windows.com",),
        "WNS defaults for apps that set none: allowed channel hosts (comma-separated: "
        "*.domain, host, host:port, host:*; docs/windows-api.md) and token URL.",
        group=Group.WORKERS,
        shown="*.notify.windows.com",
    )
    wns_token_url: str = var(
        "RELAY_WNS_TOKEN_URL",
        "https://login.live.com/accesstoken.srf",
        "",
        group=Group.WORKERS,
    )
    requests_ca_bundle: str = var(
        "REQUESTS_CA_BUNDLE",
        "",
        "A CA bundle for FCM's and Web Push's HTTPS calls instead of certifi's (a private "
        "endpoint, a TLS-inspecting proxy); the first is read, else the second.",
        group=Group.WORKERS,
    )
    curl_ca_bundle: str = var("CURL_CA_BUNDLE", "", "", group=Group.WORKERS)

    # ------------------------------------------------------------ Windows clients (UWPX)
    uwpx_stale_days: float = var(
        "RELAY_UWPX_STALE_DAYS",
        45.0,
        "Devices whose client went silent for this many days are removed (0 keeps them), "
        "checked by beat every RELAY_UWPX_STALE_CHECK_SECONDS.",
        group=Group.WINDOWS,
    )
    uwpx_stale_check_seconds: float = var(
        "RELAY_UWPX_STALE_CHECK_SECONDS", 6 * 3600.0, "", group=Group.WINDOWS
    )
    uwpx_max_accounts: int = var(
        "RELAY_UWPX_MAX_ACCOUNTS",
        32,
        "Accounts per device, and the largest request body (bytes).",
        group=Group.WINDOWS,
    )
    uwpx_max_body_bytes: int = var("RELAY_UWPX_MAX_BODY_BYTES", 32 * 1024, "", group=Group.WINDOWS)
    uwpx_rate_limit_address: CountPerSeconds = var(
        "RELAY_UWPX_RATE_LIMIT_ADDRESS",
        (120, 60.0),
        "Rate limits, count/seconds: per client address, per device, test pushes per device.",
        group=Group.WINDOWS,
        shown="120/60",
    )
    uwpx_rate_limit_device: CountPerSeconds = var(
        "RELAY_UWPX_RATE_LIMIT_DEVICE", (30, 60.0), "", group=Group.WINDOWS, shown="30/60"
    )
    uwpx_rate_limit_test_push: CountPerSeconds = var(
        "RELAY_UWPX_RATE_LIMIT_TEST_PUSH", (5, 600.0), "", group=Group.WINDOWS, shown="5/600"
    )
    uwpx_listen_address: str = var(
        "UWPX_LISTEN_ADDRESS",
        "127.0.0.1",
        "The TLS listener for unmodified UWPX clients; it idles until UWPX_LISTEN_APP and the "
        "certificate are set. Compose sets the address to 0.0.0.0 inside its container.",
        group=Group.WINDOWS,
    )
    uwpx_listen_port: int = var("UWPX_LISTEN_PORT", 1997, "", group=Group.WINDOWS)
    uwpx_listen_app: str = var(
        "UWPX_LISTEN_APP",
        "",
        "The app's public key (shown on the app's page in the admin).",
        group=Group.WINDOWS,
    )
    uwpx_tls_cert_file: str = var(
        "UWPX_TLS_CERT_FILE",
        "",
        "PEM certificate chain and key (compose: files under RELAY_CONFIG_DIR, e.g. "
        "/etc/push-relay/uwpx.pem).",
        group=Group.WINDOWS,
    )
    uwpx_tls_key_file: str = var("UWPX_TLS_KEY_FILE", "", "", group=Group.WINDOWS)

    # ------------------------------------------------------------ reports for analysts
    retention_days: int = var(
        "RELAY_RETENTION_DAYS",
        90,
        "Records (deliveries, UnifiedPush deliveries, publish tallies, registration events, "
        "audit entries) "
        "older than this many days are pruned by `manage.py prune_records` and the beat entry "
        "at RELAY_PRUNE_AT (UTC, HH:MM; empty turns it off).",
        group=Group.REPORTS,
    )
    prune_at: str = var("RELAY_PRUNE_AT", "03:30", "", group=Group.REPORTS)
    analytics_database_url: str = var(
        "ANALYTICS_DATABASE_URL",
        "",
        "The PostgreSQL read replica the Spark jobs read (defaults to DATABASE_URL); once set, "
        "the beat entry runs the daily report at RELAY_REPORTS_AT (UTC, HH:MM; empty turns it "
        "off).",
        group=Group.REPORTS,
        example="postgres://reports@replica.internal:5432/push",
    )
    reports_at: str = var(
        "RELAY_REPORTS_AT",
        "",
        "",
        group=Group.REPORTS,
        shown="02:30 once ANALYTICS_DATABASE_URL is set",
        example="02:30",
    )
    analytics_output: str = var(
        "ANALYTICS_OUTPUT",
        "",
        "Where the Parquet output goes (a local path or any URI Spark's Hadoop layer writes "
        "to), and the folder for the monthly CSV exports and the HTML report.",
        group=Group.REPORTS,
        shown="VAR_DIR/reports",
    )
    analytics_export_dir: str = var(
        "ANALYTICS_EXPORT_DIR", "", "", group=Group.REPORTS, shown="VAR_DIR/reports-export"
    )
    analytics_spark_master: str = var(
        "ANALYTICS_SPARK_MASTER",
        "",
        "Spark: the master, the PostgreSQL JDBC driver, the driver's memory, rows per JDBC "
        "partition and the shuffle partitions.",
        group=Group.REPORTS,
        shown="local[*]",
        example="spark://spark-master:7077",
    )
    analytics_jdbc_jar: str = var(
        "ANALYTICS_JDBC_JAR", "/usr/share/java/postgresql.jar", "", group=Group.REPORTS
    )
    analytics_driver_memory: str = var("ANALYTICS_DRIVER_MEMORY", "2g", "", group=Group.REPORTS)
    analytics_rows_per_partition: int = var(
        "ANALYTICS_ROWS_PER_PARTITION", 500_000, "", group=Group.REPORTS
    )
    analytics_shuffle_partitions: int = var(
        "ANALYTICS_SHUFFLE_PARTITIONS", 4, "", group=Group.REPORTS
    )
    analytics_volume_change: float = var(
        "ANALYTICS_VOLUME_CHANGE",
        1.0,
        "Anomalies: a change of volume (1.0 = +100 %) or of failure rate (0.1 = 10 points) "
        "against the last 7 days, for series with at least ANALYTICS_MIN_VOLUME pushes a day.",
        group=Group.REPORTS,
    )
    analytics_failure_rate_change: float = var(
        "ANALYTICS_FAILURE_RATE_CHANGE", 0.1, "", group=Group.REPORTS
    )
    analytics_min_volume: int = var("ANALYTICS_MIN_VOLUME", 50, "", group=Group.REPORTS)

    # ------------------------------------------------------------ UnifiedPush
    unifiedpush_max_ttl_seconds: int = var(
        "RELAY_UNIFIEDPUSH_MAX_TTL_SECONDS",
        2 * 86400,
        "The longest TTL granted, and the TTL assumed when a POST sends none (seconds).",
        group=Group.UNIFIEDPUSH,
    )
    unifiedpush_default_ttl_seconds: int = var(
        "RELAY_UNIFIEDPUSH_DEFAULT_TTL_SECONDS", 86400, "", group=Group.UNIFIEDPUSH
    )
    unifiedpush_max_stored_per_endpoint: int = var(
        "RELAY_UNIFIEDPUSH_MAX_STORED_PER_ENDPOINT",
        100,
        "Undelivered messages kept per endpoint; beyond, the oldest of the least urgent is "
        "dropped.",
        group=Group.UNIFIEDPUSH,
    )
    unifiedpush_endpoint_rate: RateBurst = var(
        "RELAY_UNIFIEDPUSH_ENDPOINT_RATE",
        (10.0, 100.0),
        "Token buckets rate/burst per web process, per endpoint and per tenant (a tenant's "
        "own rate wins); excess POSTs get 429 with Retry-After; 0/0 turns one off.",
        group=Group.UNIFIEDPUSH,
        shown="10/100",
    )
    unifiedpush_tenant_rate: RateBurst = var(
        "RELAY_UNIFIEDPUSH_TENANT_RATE",
        (1000.0, 10000.0),
        "",
        group=Group.UNIFIEDPUSH,
        shown="1000/10000",
    )
    unifiedpush_answer_timeout_seconds: float = var(
        "RELAY_UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS",
        60.0,
        "How long the phone has to answer a push before it counts as away (seconds).",
        group=Group.UNIFIEDPUSH,
    )
    unifiedpush_retry_base_seconds: float = var(
        "RELAY_UNIFIEDPUSH_RETRY_BASE_SECONDS",
        5.0,
        "Backoff with jitter after a temporary error (seconds); a push left unanswered waits "
        "the maximum; never beyond the message's TTL.",
        group=Group.UNIFIEDPUSH,
    )
    unifiedpush_retry_max_seconds: float = var(
        "RELAY_UNIFIEDPUSH_RETRY_MAX_SECONDS", 600.0, "", group=Group.UNIFIEDPUSH
    )
    unifiedpush_sweep_seconds: float = var(
        "RELAY_UNIFIEDPUSH_SWEEP_SECONDS",
        5.0,
        "How often the gateway looks for stored messages that are due (behind PostgreSQL's "
        "NOTIFY; on SQLite the only wake-up).",
        group=Group.UNIFIEDPUSH,
        shown="5 (0.25 on SQLite)",
        example="5",
    )
    unifiedpush_direct_seconds: float = var(
        "RELAY_UNIFIEDPUSH_DIRECT_SECONDS",
        0.5,
        "The direct path: how long a POST for an online phone waits for its answer before the "
        "gateway stores the message (seconds; 0 stores every message first), and where the "
        "gateway listens for web processes (host:port; port 0 picks a free one; off). "
        "Loopback unless web and gateway run on different hosts: then a private address, "
        "never a public one.",
        group=Group.UNIFIEDPUSH,
    )
    unifiedpush_channel: str = var(
        "RELAY_UNIFIEDPUSH_CHANNEL", "127.0.0.1:0", "", group=Group.UNIFIEDPUSH
    )

    # ------------------------------------------------------------ watching it
    metrics_token: str = var(
        "METRICS_TOKEN",
        "",
        "When set, /metrics (of web, and of the gateway's and worker's probe listeners) "
        "answers only requests with `Authorization: Bearer <METRICS_TOKEN>`.",
        group=Group.WATCHING,
    )
    gateway_probe_listen: str = var(
        "GATEWAY_PROBE_LISTEN",
        "127.0.0.1:9101",
        "The gateway's and the worker's HTTP listener for /healthz, /readyz and /metrics "
        "(host:port; port 0 picks a free one, logged at start; empty turns it off). Two "
        "workers on one host need two ports.",
        group=Group.WATCHING,
    )
    worker_probe_listen: str = var(
        "WORKER_PROBE_LISTEN", "127.0.0.1:9102", "", group=Group.WATCHING
    )
    web_metrics_dir: str = var(
        "WEB_METRICS_DIR",
        "",
        "Where the web process's workers keep their metric values, added up by /metrics "
        "(emptied at start; a tmpfs is best). The web process hands it to its workers as "
        "PROMETHEUS_MULTIPROC_DIR: never set that one here (the gateway and the worker would "
        "write into the web's files).",
        group=Group.WATCHING,
        shown="a fresh temporary directory",
    )

    # ------------------------------------------------------------ derived
    def given(self, name: str) -> bool:
        """Whether the environment set this field (a default may then be derived instead)."""
        return name in self.model_fields_set

    @property
    def production(self) -> bool:
        """DEPLOYMENT=production."""
        return self.deployment.lower() == "production"

    @property
    def broker_visibility_timeout(self) -> float | None:
        """Seconds an unacknowledged send waits before it is delivered again; None for a
        broker without one."""
        if self.celery_broker_url.startswith("sqlrelay+"):
            return float(self.celery_visibility_timeout)
        return None


def declared() -> Iterator[tuple[str, str, FieldInfo]]:
    """(field name, environment variable, declaration), in declaration order."""
    for name, info in Environment.model_fields.items():
        yield name, str(info.validation_alias), info


def _extra(info: FieldInfo) -> dict[str, Any]:
    extra = info.json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


def _written(value: Any) -> str:
    """A default as the environment would spell it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(item, int | float) for item in value)
    ):
        return "/".join(_number(item) for item in value)
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    if isinstance(value, float):
        return _number(value)
    return str(value)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def shown_default(info: FieldInfo) -> str:
    shown = _extra(info).get("shown")
    return str(shown) if shown is not None else _written(info.default)


ENV_EXAMPLE_HEAD = """\
# Every environment variable the relay reads, with its default. Generated from
# relay/environment.py (`manage.py environment --write`): edit the declarations, not this file.
#
# Docker:  cp .env.example .env                        (compose.yaml reads ./.env)
# systemd: install -m 0640 -g push-relay .env.example /etc/push-relay/push-relay.env
# Fill in the required values below; a commented line shows a default, uncomment it to
# change it. One NAME=value per line, no quotes, no comment after a value (systemd and Compose
# read this file alike). This file holds secrets: keep it out of version control, back it up.
"""


def env_example() -> str:
    """.env.example: the required values set (empty), every other one commented out."""
    lines = [ENV_EXAMPLE_HEAD]
    group = None
    for _, env, info in declared():
        extra = _extra(info)
        if extra["group"] != group:
            group = extra["group"]
            lines.append(f"\n# {'=' * 64} {group}")
        value = extra.get("example")
        if value is None:
            value = shown_default(info)
        description = info.description or ""
        if " " in value:  # a derived default, said in words: the line stays a valid assignment
            description += f"{' ' if description else ''}Default: {value}."
            value = ""
        for paragraph in description.split("\n") if description else ():
            if paragraph.startswith("  "):  # a command, kept whole
                lines.append(f"# {paragraph}")
                continue
            lines += textwrap.wrap(paragraph, width=95, initial_indent="# ", subsequent_indent="# ")
        if extra["group"] == Group.REQUIRED.value and extra.get("example") is not None:
            lines.append(f"{env}={value}")
        elif extra["group"] == Group.COMPOSE.value and extra.get("example") == "":
            lines.append(f"{env}=")
        else:
            lines.append(f"# {env}={value}")
    return "\n".join(lines) + "\n"


TABLE_HEAD = ["| variable | default | meaning |", "|---|---|---|"]


def configuration_table() -> str:
    """docs/configuration.md's table: every variable, its default and meaning, by group."""
    lines = []
    group = None
    previous = ""
    for _, env, info in declared():
        extra = _extra(info)
        if extra["group"] != group:
            group = extra["group"]
            lines += ["", f"### {group[0].upper()}{group[1:]}", "", *TABLE_HEAD]
        meaning = " ".join((info.description or "").split()) or f"as {previous}"
        if info.description:
            previous = f"`{env}`"
        read_by = extra.get("read_by")
        if read_by:
            meaning += f" (read by {read_by})"
        shown = extra.get("shown")
        default = _written(info.default) if shown is None else str(shown)
        cell = (f"`{default}`" if shown is None else default) if default else "empty"
        lines.append(f"| `{env}` | {cell} | {meaning} |")
    return "\n".join(lines).lstrip("\n") + "\n"
