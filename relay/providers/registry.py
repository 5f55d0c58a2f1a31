"""The push providers the relay has: one line each. The core loops over this table; a provider
is its package under relay/providers/ and its `SPEC` (relay/providers/spec.py)."""

from __future__ import annotations

from relay.providers.apns.spec import SPEC as APNS
from relay.providers.fcm.spec import SPEC as FCM
from relay.providers.spec import ProviderSpec
from relay.providers.webpush.spec import SPEC as WEBPUSH
from relay.providers.wns.spec import SPEC as WNS

PROVIDERS: tuple[ProviderSpec, ...] = (FCM, APNS, WNS, WEBPUSH)

BY_SERVICE: dict[str, ProviderSpec] = {spec.service: spec for spec in PROVIDERS}


def spec_for(service: str) -> ProviderSpec:
    """The provider named `service`; KeyError for one the relay does not have."""
    return BY_SERVICE[service]
