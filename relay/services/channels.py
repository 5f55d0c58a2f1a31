"""Whether a device's provider address can ever be sent to: checked when it is registered.

An address the worker would refuse (a WNS channel URI whose host or port is not on the app's
channel hosts, a Web Push endpoint on a host the app does not allow) must not be registered:
the phone would be told `completed`, and every push to it would go straight to the dead
letters. Registration asks the provider's own question (`ProviderSpec.refuse_token`, the test
its client applies before each send) with the app's stored values, and refuses with a text
that says what is wrong. Both ways in use it: the ad-hoc commands `register-push-<service>`
(`relay.services.registrations.register_device`) and the Windows API
(`relay.windows.services.identifiers`, through `wns_channel_sendable`).

WNS channel host patterns (the app's "WNS channel hosts", one per line, or the site default
`RELAY_WNS_CHANNEL_HOSTS`): docs/windows-api.md.
"""

from __future__ import annotations

from typing import Any

from relay import conf
from relay.crypto import CredentialKeyError
from relay.models import App
from relay.providers.registry import spec_for
from relay.providers.wns import spec as wns
from relay.services.credentials import records

# The longest channel URI accepted (WNS's are about 200 characters).
MAX_CHANNEL_URI_LENGTH = wns.MAX_CHANNEL_URI_LENGTH


class ChannelRefused(ValueError):
    """The address can never be sent to; the message is for the registering client."""


def _setting(name: str) -> Any:
    return getattr(conf.current(), name)


def _values(app: App, service: str) -> dict[str, Any]:
    try:
        return records.values_of(app, service)
    except CredentialKeyError:
        return spec_for(service).complete({})


def wns_channel_hosts(*, app: App) -> tuple[str, ...]:
    """Where this app's channel URIs may point: the app's list, else the site default."""
    return wns.channel_hosts(_values(app, "wns"), _setting)


def wns_channel_sendable(*, app: App, channel_uri: str) -> bool:
    """The worker's own test (WnsProvider.send refuses anything that fails it)."""
    return wns.channel_sendable(wns_channel_hosts(app=app), channel_uri)


def why_not_sendable(*, app: App, channel_uri: object) -> str:
    """A clear reason, naming the app's patterns but never echoing the URI itself."""
    return wns.why_not_sendable(wns_channel_hosts(app=app), channel_uri)


def check_sendable(*, app_id: int, service: str, token: str) -> None:
    """Raise ChannelRefused for an address the app can never send to.

    The app's credentials are read afresh: a long-lived caller (the gateway) may hold an old
    copy, and the operator may have just changed them.
    """
    spec = spec_for(service)
    if spec.refuse_token is None:
        return
    app = App.objects.only("id").get(pk=app_id)
    reason = spec.refuse_token(_values(app, service), token, _setting)
    if reason:
        raise ChannelRefused(reason)
