"""Whether a device's provider address can ever be sent to: checked when it is registered.

A WNS channel URI the worker would refuse (its host or port not on the app's channel hosts)
must not be registered: the phone would be told `completed`, and every push to it would go
straight to the dead letters. Registration asks the same question the worker asks before
each send, `relay.providers.wns.channel_uri_allowed` with the app's hosts from
`relay.services.credentials.configs.wns_channel_hosts`, and refuses with a text that says what is
wrong. Both ways in use it: the ad-hoc command `register-push-wns`
(`relay.services.registrations.register_device`) and the Windows API
(`relay.windows.services.identifiers`).

Channel host patterns (the app's "WNS channel hosts", one per line, or the site default
`RELAY_WNS_CHANNEL_HOSTS`):

- `*.notify.windows.com`: any subdomain (not the domain itself), https on port 443 only;
- `host` or `1.2.3.4`: that host, on the scheme's default port only (443; 80 for http);
- `host:8443`: that host on that port; `host:*`: on any port; IPv6 as `[::1]:*`;
- plain `http://` only for loopback hosts (test fakes), https for everything else.

So a bare `127.0.0.1` does not allow `http://127.0.0.1:8080/…`: write `127.0.0.1:8080` or
`127.0.0.1:*`. The refusal says so.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from relay.models import App, Service
from relay.providers.wns import channel_uri_allowed, parse_host_pattern
from relay.services.credentials.configs import wns_channel_hosts

# The longest channel URI accepted (WNS's are about 200 characters).
MAX_CHANNEL_URI_LENGTH = 2048
_DEFAULT_PORTS = {"https": 443, "http": 80}


class ChannelRefused(ValueError):
    """The address can never be sent to; the message is for the registering client."""


def wns_channel_sendable(*, app: App, channel_uri: str) -> bool:
    """The worker's own test (WnsProvider.send refuses anything that fails it)."""
    return (
        isinstance(channel_uri, str)
        and len(channel_uri) <= MAX_CHANNEL_URI_LENGTH
        and channel_uri_allowed(channel_uri, wns_channel_hosts(app=app))
    )


def check_sendable(*, app_id: int, service: str, token: str) -> None:
    """Raise ChannelRefused for an address the app can never send to; other services pass.

    The app is read afresh: a long-lived caller (the gateway) may hold an old copy, and the
    operator may have just changed its channel hosts.
    """
    if service != Service.WNS:
        return
    app = App.objects.only("id", "wns_channel_hosts").get(pk=app_id)
    if not wns_channel_sendable(app=app, channel_uri=token):
        raise ChannelRefused(why_not_sendable(app=app, channel_uri=token))


def why_not_sendable(*, app: App, channel_uri: object) -> str:
    """A clear reason, naming the app's patterns but never echoing the URI itself."""
    hosts = wns_channel_hosts(app=app)
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
