"""Web Push as the relay plugs it in: the app's VAPID key and contact, where endpoints may
point, and the registration command's fields (the browser's PushSubscription)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from relay.providers.base import PushProvider
from relay.providers.spec import BuildContext, CredentialField, ProviderSpec, Registration, Values

ENDPOINT_HOSTS_HELP = (
    "Where this app's subscription endpoints may point, one pattern per line, as for WNS "
    "channel hosts ('*.push.example.org', 'ntfy.example.net', 'host:8443', 'host:*'); empty: "
    "any public https host. A device registering an endpoint outside these is refused."
)


def _text(values: Values, name: str) -> str:
    return str(values.get(name) or "")


def _hosts(values: Values) -> tuple[str, ...]:
    return tuple(
        line.strip() for line in _text(values, "endpoint_hosts").splitlines() if line.strip()
    )


def _ttl(values: Values) -> int:
    from relay.providers.webpush import DEFAULT_TTL

    text = _text(values, "ttl").strip()
    return int(text) if text else DEFAULT_TTL


def _configured(values: Values) -> bool:
    return bool(_text(values, "private_key").strip())


def _config(values: Values) -> Any:
    from relay.providers.webpush import WebPushConfig

    try:
        ttl = _ttl(values)
    except ValueError:
        raise ValueError("The TTL must be a number of seconds") from None
    return WebPushConfig(
        private_key=_text(values, "private_key"),
        subject=_text(values, "subject").strip(),
        endpoint_hosts=_hosts(values),
        ttl=ttl,
        topic=bool(values.get("topic")),
    )


def _validate(values: Values) -> dict[str, str]:
    from relay.providers.webpush import _SUBJECT, MAX_TTL, validate_private_key
    from relay.providers.wns import parse_host_pattern

    errors: dict[str, str] = {}
    if not _configured(values):
        return errors
    try:
        validate_private_key(_text(values, "private_key"))
    except ValueError as error:
        errors["private_key"] = f"{error}."
    if not _SUBJECT.fullmatch(_text(values, "subject").strip()):
        errors["subject"] = "The contact must be a mailto: address or an https URL."
    try:
        if not 0 <= _ttl(values) <= MAX_TTL:
            raise ValueError
    except ValueError:
        errors["ttl"] = f"The TTL must be 0 to {MAX_TTL} seconds."
    for pattern in _hosts(values):
        try:
            parse_host_pattern(pattern)
        except ValueError as error:
            errors.setdefault("endpoint_hosts", f"{pattern!r}: {error}")
    return errors


def _build(values: Values, context: BuildContext) -> PushProvider:
    from relay.providers.webpush import WebPushProvider

    # The CA bundle's settings (REQUESTS_CA_BUNDLE, else CURL_CA_BUNDLE), as FCM's.
    ca_bundle = context.setting("requests_ca_bundle") or context.setting("curl_ca_bundle") or ""
    return WebPushProvider(_config(values), timeout=context.timeout, ca_bundle=str(ca_bundle))


def _summary(values: Values) -> list[tuple[str, str]]:
    from relay.providers.webpush import public_key

    try:
        return [("Web Push VAPID public key", public_key(_text(values, "private_key")))]
    except Exception:  # an unusable key: its fingerprint line says it is set
        return []


def _generate() -> dict[str, str]:
    from relay.providers.webpush import new_private_key

    return {"private_key": new_private_key()}


def _token(fields: Mapping[str, str]) -> str:
    from relay.providers.webpush import subscription

    return subscription(
        fields.get("endpoint") or "", fields.get("p256dh") or "", fields.get("auth") or ""
    ).token()


def _refuse_token(values: Values, token: str, setting: Callable[[str], Any]) -> str:
    from relay.providers.webpush import endpoint_allowed, parse_token, why_not_allowed

    try:
        endpoint = parse_token(token).endpoint
    except ValueError as error:
        return str(error)
    hosts = _hosts(values)
    return "" if endpoint_allowed(endpoint, hosts) else why_not_allowed(endpoint, hosts)


SPEC = ProviderSpec(
    service="webpush",
    label="Web Push",
    code="WEBPUSH",
    description="A VAPID key pair (generate one here, or paste a PEM private key) and its "
    "contact; clients subscribe with the public key shown under credentials.",
    fields=(
        CredentialField(
            "private_key",
            "VAPID private key, PEM",
            "secret_text",
            help="EC P-256; the public key is what clients subscribe with.",
            upload=".pem,.key",
            required=True,
        ),
        CredentialField(
            "subject",
            "Contact (sub)",
            help="mailto:ops@example.org or an https URL: whom a push service may contact.",
            required=True,
        ),
        CredentialField("endpoint_hosts", "Endpoint hosts", "lines", help=ENDPOINT_HOSTS_HELP),
        CredentialField(
            "ttl", "TTL (seconds)", help="How long a push service keeps a wake-up; empty: 86400."
        ),
        CredentialField(
            "topic",
            "Collapse wake-ups (Topic)",
            "bool",
            help="A push service then keeps only the newest waiting wake-up per account.",
        ),
    ),
    configured=_configured,
    validate=_validate,
    build=_build,
    summary=_summary,
    registration=Registration(fields=("endpoint", "p256dh", "auth"), token=_token),
    refuse_token=_refuse_token,
    generate=_generate,
)
