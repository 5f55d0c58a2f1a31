"""System checks: credentials a configured key cannot read, pending rotations, expiring certs.

They run with `manage.py check` (and migrate, runserver), so an operator who dropped a key
too early hears about it before the first push fails. One small query per table that holds
encrypted values; a database that is not there yet (first migrate) is skipped silently.
"""

from __future__ import annotations

from typing import Any

from cryptography.fernet import Fernet
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DatabaseError

from relay import conf


@register("relay")
def credential_keys_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    keys = list(conf.current().credential_keys)
    if not keys:
        return [Error("CREDENTIAL_KEYS is empty: credentials cannot be stored.", id="relay.E001")]
    for index, key in enumerate(keys):
        try:
            Fernet(key.encode())
        except (ValueError, TypeError):
            return [
                Error(
                    f"CREDENTIAL_KEYS entry {index + 1} is not a Fernet key.",
                    hint="Generate one with: python -c 'from cryptography.fernet import "
                    "Fernet; print(Fernet.generate_key().decode())'",
                    id="relay.E002",
                )
            ]
    from relay.services.credentials import keys as credential_keys
    from relay.services.credentials import selectors as credential_selectors

    try:
        status = credential_keys.credential_key_status()
        expiring = list(credential_selectors.certificates_expiring()[:20])
    except DatabaseError:
        return []
    messages: list[CheckMessage] = []
    if status.unreadable:
        messages.append(
            Warning(
                f"{status.unreadable} stored credential value(s) cannot be decrypted with any "
                "configured CREDENTIAL_KEYS entry; those providers will not send.",
                hint="Add the key they were encrypted with back to CREDENTIAL_KEYS, "
                "or enter the credentials again in the admin.",
                id="relay.W001",
            )
        )
    if status.rotation_pending:
        messages.append(
            Warning(
                f"{status.rotation_pending} stored credential value(s) are not encrypted with "
                "the current (first) CREDENTIAL_KEYS entry.",
                hint="Run `manage.py rotate_credentials` before removing old keys.",
                id="relay.W002",
            )
        )
    for app in expiring:
        messages.append(
            Warning(
                credential_selectors.expiry_warning(app=app) or f"{app}: certificate",
                id="relay.W003",
            )
        )
    return messages


@register("relay")
def tenant_scope_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Staff who see nothing, and tenant groups that were also given operator status."""
    from relay.services import tenancy

    try:
        unconfined = tenancy.unconfined_staff_count()
        conflicting = tenancy.bound_operator_groups()
    except DatabaseError:
        return []
    messages: list[CheckMessage] = []
    if unconfined:
        messages.append(
            Warning(
                f"{unconfined} active staff user(s) are neither superusers, in the "
                f"{tenancy.OPERATORS_GROUP!r} group (permission {tenancy.OPERATOR_PERMISSION}) "
                "nor in a tenant's staff group: they see no tenant in the admin.",
                hint=f"Add the operator's staff to the {tenancy.OPERATORS_GROUP!r} group, and "
                "a tenant's staff to that tenant's staff group (docs/operators.md, Roles).",
                id="relay.W010",
            )
        )
    for name in conflicting:
        messages.append(
            Warning(
                f"The group {name!r} is bound to a tenant and holds "
                f"{tenancy.OPERATOR_PERMISSION}: its members stay confined to the tenant.",
                hint="Remove the permission from the group, or its tenant binding.",
                id="relay.W011",
            )
        )
    return messages


@register("relay")
def login_settings_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    if conf.current().login_max_failures_per_address:
        return [
            Warning(
                "RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS is no longer used: logins are locked out "
                "per username and address together, so one address (a proxy's) can never lock "
                "every admin out.",
                hint="Remove it; RELAY_LOGIN_MAX_FAILURES and RELAY_LOGIN_LOCKOUT_SECONDS apply "
                "to each username and address pair.",
                id="relay.W020",
            )
        ]
    return []


@register("relay")
def gateway_limits_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Stanza limits a real publish would break: every such publish would end the link."""
    relay = conf.current()
    messages: list[CheckMessage] = []
    smallest = relay.max_field_length * 2 + 4096  # a publish with a long field or two
    if relay.max_stanza_bytes < smallest:
        messages.append(
            Error(
                f"RELAY_MAX_STANZA_BYTES ({relay.max_stanza_bytes}) is below {smallest}: a "
                "publish with form fields of RELAY_MAX_FIELD_LENGTH would end its link.",
                id="relay.E101",
            )
        )
    if relay.max_stanza_depth < 10:
        messages.append(
            Error("RELAY_MAX_STANZA_DEPTH is below 10: publishes nest 8 deep.", id="relay.E102")
        )
    if relay.link_max_in_flight < 1:
        messages.append(Error("RELAY_LINK_MAX_IN_FLIGHT must be at least 1.", id="relay.E103"))
    from relay.services.link_leases import DROP_MARGIN_SECONDS

    lease, renew = relay.gateway_lease_seconds, relay.gateway_renew_seconds
    if renew <= 0 or renew * 2 + DROP_MARGIN_SECONDS >= lease:
        # The holder drops a link DROP_MARGIN before its lease can expire: it must be able to
        # miss one renewal without dropping every link.
        messages.append(
            Error(
                f"RELAY_GATEWAY_RENEW_SECONDS ({renew}) must be above 0 and twice it plus "
                f"{DROP_MARGIN_SECONDS} below RELAY_GATEWAY_LEASE_SECONDS ({lease}).",
                id="relay.E107",
            )
        )
    return messages


@register("relay")
def probe_listen_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A listener address the gateway or the worker could not parse would only show up as a
    crash at start; say it here."""
    from relay.probes import parse_listen

    messages: list[CheckMessage] = []
    relay = conf.current()
    listens = {
        "GATEWAY_PROBE_LISTEN": relay.gateway_probe_listen,
        "WORKER_PROBE_LISTEN": relay.worker_probe_listen,
    }
    for name, listen in listens.items():
        try:
            address = parse_listen(listen)
        except ValueError:
            address = None
            messages.append(
                Error(
                    f"{name} must be host:port (e.g. 127.0.0.1:9101), or empty to turn the "
                    "listener off.",
                    id="relay.E120",
                )
            )
        if address is not None and not 0 <= address[1] <= 65535:
            messages.append(Error(f"{name}: the port must be 0 to 65535.", id="relay.E120"))
    return messages


@register("relay")
def web_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The web process's address, processes and limits (pushsite/server.py): a wrong value
    would only show as a crash at its start, or as a limit that refuses every request."""
    from relay.probes import parse_listen

    relay = conf.current()
    messages: list[CheckMessage] = []
    try:
        address = parse_listen(relay.web_bind)
    except ValueError:
        address = None
    if address is None or not 0 <= address[1] <= 65535:
        messages.append(Error("WEB_BIND must be host:port (e.g. 127.0.0.1:8000).", id="relay.E130"))
    if relay.web_workers < 1 or relay.web_threads < 1 or relay.web_max_connections < 1:
        messages.append(
            Error(
                "WEB_WORKERS, WEB_THREADS and WEB_MAX_CONNECTIONS must be at least 1.",
                id="relay.E131",
            )
        )
    if relay.web_max_head_bytes < 1024 or relay.web_max_headers < 10:
        messages.append(
            Error(
                "WEB_MAX_HEAD_BYTES must be at least 1024 and WEB_MAX_HEADERS at least 10: "
                "browsers and proxies send that much.",
                id="relay.E132",
            )
        )
    if not 256 <= relay.web_max_request_line <= relay.web_max_head_bytes:
        messages.append(
            Error(
                "WEB_MAX_REQUEST_LINE must be at least 256 (an endpoint URL is up to 1000 "
                "bytes: 1100 or more is wise) and at most WEB_MAX_HEAD_BYTES.",
                id="relay.E132",
            )
        )
    if relay.web_max_body_bytes < 64 * 1024:
        messages.append(
            Error(
                "WEB_MAX_BODY_BYTES must be at least 65536 (a Matrix notification, an admin form).",
                id="relay.E132",
            )
        )
    deadlines = {
        "WEB_HEAD_SECONDS": relay.web_head_seconds,
        "WEB_BODY_SECONDS": relay.web_body_seconds,
        "WEB_FLUSH_SECONDS": relay.web_flush_seconds,
        "WEB_GRACEFUL_SECONDS": relay.web_graceful_seconds,
    }
    for name, seconds in deadlines.items():
        if not seconds > 0:
            messages.append(Error(f"{name} must be more than 0 seconds.", id="relay.E133"))
    return messages


@register("relay")
def retry_window_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A delayed send (a retry, or a coalesced send) waits unacknowledged in a worker until it
    is due; a broker visibility timeout shorter than that delay hands it to a second worker,
    and the phone is woken twice."""
    relay = conf.current()
    visibility = relay.broker_visibility_timeout
    longest = max(relay.send_retry_max_seconds, relay.coalesce_seconds)
    if visibility is None or visibility > longest:
        return []
    return [
        Error(
            f"CELERY_VISIBILITY_TIMEOUT ({visibility:g} s) must exceed the longest retry delay "
            f"({longest:g} s, RELAY_SEND_RETRY_MAX_SECONDS or RELAY_COALESCE_SECONDS).",
            hint="Raise CELERY_VISIBILITY_TIMEOUT or lower RELAY_SEND_RETRY_MAX_SECONDS.",
            id="relay.E104",
        )
    ]


@register("relay")
def broker_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The Redis broker is gone (its queue could lose the last second of sends with its host):
    a redis:// broker URL would give kombu's own Redis transport, without the relay's
    guarantees, so it is refused rather than run."""
    url = conf.current().celery_broker_url
    if not url.startswith(("redis://", "rediss://", "sentinel://")):
        return []
    return [
        Error(
            "CELERY_BROKER_URL: Redis is no longer a broker of the relay.",
            hint="Run RabbitMQ (docs/broker.md); drain the Redis queue first "
            "(manage.py drain_redis_broker) and keep Redis as RELAY_STATE_URL.",
            id="relay.E140",
        )
    ]


@register("relay", Tags.database)
def state_store_check(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """The shared state store (coalescing windows, token buckets) answers. Tagged `database`:
    it runs with `migrate` and `check --database default` (the deploy steps before the
    processes start), not with every command; unreachable, the relay would fail open on every
    publish (no coalescing, no tenant limits) with only a log line to show for it."""
    if not databases:
        return []
    from relay.services import throttling

    try:
        throttling.check_store()
    except ValueError as error:
        return [Error(str(error), id="relay.E105")]
    except throttling.StateUnavailable as error:
        return [
            Error(
                f"The state store (RELAY_STATE_URL) does not answer: {error}.",
                hint="Start it, or point RELAY_STATE_URL at one that runs (redis://... or "
                "sqlite:///path).",
                id="relay.E106",
            )
        ]
    return []
