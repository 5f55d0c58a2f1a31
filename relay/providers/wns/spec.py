"""Windows Push Notification Services as the relay plugs it in: the Partner Center's package
SID and secret, and where channel URIs may point."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from relay.providers.base import PushProvider
from relay.providers.payloads import wns_payload
from relay.providers.spec import BuildContext, CredentialField, ProviderSpec, Values

_PACKAGE_SID = re.compile(r"ms-app://s-1-15-2(?:-[0-9]+)+", re.IGNORECASE)
# The longest channel URI accepted (WNS's are about 200 characters).
MAX_CHANNEL_URI_LENGTH = 2048
_DEFAULT_PORTS = {"https": 443, "http": 80}
# The syntax of relay.providers.wns.parse_host_pattern (docs/windows-api.md).
CHANNEL_HOSTS_HELP = (
    "Where this app's channel URIs may point, one pattern per line; empty: the site default "
    "(*.notify.windows.com). '*.example.com' allows its subdomains on port 443; a bare host "
    "('wns.example.net', '127.0.0.1') allows the default port only (443, or 80 for http); "
    "'host:8443' one port, 'host:*' any port. Plain http only for loopback hosts. A device "
    "registering a channel outside these is refused."
)


def lines(text: object) -> tuple[str, ...]:
    """The non-blank lines of a multi-line field, stripped."""
    return tuple(line.strip() for line in str(text or "").splitlines() if line.strip())


def _text(values: Values, name: str) -> str:
    return str(values.get(name) or "")


def channel_hosts(values: Values, setting: Callable[[str], Any]) -> tuple[str, ...]:
    """Where this app's channel URIs may point: the app's list, else the site default."""
    from relay.providers.wns import DEFAULT_CHANNEL_HOSTS

    hosts = lines(values.get("channel_hosts"))
    return hosts or tuple(setting("wns_channel_hosts") or DEFAULT_CHANNEL_HOSTS)


def token_url(values: Values, setting: Callable[[str], Any]) -> str:
    from relay.providers.wns import DEFAULT_TOKEN_URL

    return _text(values, "token_url") or setting("wns_token_url") or DEFAULT_TOKEN_URL


def _configured(values: Values) -> bool:
    return bool(_text(values, "package_sid").strip() or _text(values, "secret"))


def _validate(values: Values) -> dict[str, str]:
    from relay.providers.wns import WnsConfig, parse_host_pattern

    errors: dict[str, str] = {}
    if not _configured(values):
        return errors
    package_sid, secret = _text(values, "package_sid"), _text(values, "secret")
    if not _PACKAGE_SID.fullmatch(package_sid):
        errors["package_sid"] = "The package SID must look like ms-app://s-1-15-2-…."
    if not secret:
        errors["secret"] = "The client secret is required with a package SID."
    elif secret != secret.strip():
        errors["secret"] = "The client secret has surrounding whitespace (a paste error?)."
    url = _text(values, "token_url")
    if url:
        try:
            WnsConfig(package_sid="ms-app://s-1-15-2-1", secret="-", token_url=url).validate()
        except ValueError as error:
            errors["token_url"] = f"{error}."
    for pattern in lines(values.get("channel_hosts")):
        try:
            parse_host_pattern(pattern)
        except ValueError as error:
            errors.setdefault("channel_hosts", f"{pattern!r}: {error}")
    return errors


def _build(values: Values, context: BuildContext) -> PushProvider:
    from relay.providers.wns import WnsConfig, WnsProvider

    config = WnsConfig(
        package_sid=_text(values, "package_sid"),
        secret=_text(values, "secret"),
        token_url=token_url(values, context.setting),
        channel_hosts=channel_hosts(values, context.setting),
    )
    config.validate()
    return WnsProvider(config, timeout=context.timeout, payload=context.payload)


def channel_sendable(hosts: tuple[str, ...], channel_uri: object) -> bool:
    """The worker's own test (WnsProvider.send refuses anything that fails it)."""
    from relay.providers.wns import channel_uri_allowed

    return (
        isinstance(channel_uri, str)
        and len(channel_uri) <= MAX_CHANNEL_URI_LENGTH
        and channel_uri_allowed(channel_uri, hosts)
    )


def why_not_sendable(hosts: tuple[str, ...], channel_uri: object) -> str:
    """A clear reason, naming the app's patterns but never echoing the URI itself."""
    from relay.providers.wns import parse_host_pattern

    allowed = f"this app's WNS channel hosts: {', '.join(hosts)}"
    prefix = "the WNS channel URI cannot be sent to: "
    if not isinstance(channel_uri, str) or len(channel_uri) > MAX_CHANNEL_URI_LENGTH:
        return f"{prefix}it must be a URI of at most {MAX_CHANNEL_URI_LENGTH} characters."
    try:
        parts = urlsplit(channel_uri)
        scheme, host, port = parts.scheme.lower(), parts.hostname or "", parts.port
    except ValueError:
        return f"{prefix}it is not a valid URI ({allowed})."
    if scheme not in _DEFAULT_PORTS or not host:
        return f"{prefix}it must be an https URI on an allowed host ({allowed})."
    port = port if port is not None else _DEFAULT_PORTS[scheme]
    for raw in hosts:
        try:
            pattern = parse_host_pattern(raw)
        except (ValueError, TypeError):
            continue
        if not pattern.wildcard and pattern.host == host and pattern.port is None:
            return (
                f"{prefix}the channel host pattern {raw.strip()!r} allows port "
                f"{_DEFAULT_PORTS[scheme]} only, not {port}; the app's operator can allow it "
                f"with {raw.strip()}:{port} (or {raw.strip()}:*)."
            )
    if scheme == "http":
        return f"{prefix}it must be https; plain http only to loopback hosts ({allowed})."
    return (
        f"{prefix}its host or port is not allowed, or it carries userinfo, a fragment or "
        f"characters no channel URI has ({allowed})."
    )


def _refuse_token(values: Values, token: str, setting: Callable[[str], Any]) -> str:
    hosts = channel_hosts(values, setting)
    return "" if channel_sendable(hosts, token) else why_not_sendable(hosts, token)


SPEC = ProviderSpec(
    service="wns",
    label="Windows Push Notification Services",
    code="WNS",
    fields=(
        CredentialField("package_sid", "Package SID", required=True),
        CredentialField("secret", "Client secret", "secret", required=True),
        CredentialField("token_url", "Token URL", "url", help="Empty means login.live.com."),
        CredentialField("channel_hosts", "Channel hosts", "lines", help=CHANNEL_HOSTS_HELP),
    ),
    configured=_configured,
    validate=_validate,
    build=_build,
    payload=wns_payload,
    refuse_token=_refuse_token,
)
