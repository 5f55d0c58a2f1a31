"""System checks of the gateway's stanza limits: a limit a real publish breaks is an error."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import override_settings

from relay.checks import gateway_limits_check

pytestmark = pytest.mark.defaults


def ids(**changes: object) -> set[str]:
    with override_settings(RELAY={**settings.RELAY, **changes}):
        return {message.id for message in gateway_limits_check()}


def test_the_defaults_pass():
    assert ids() == set()


def test_limits_a_publish_would_break_are_errors():
    assert ids(MAX_STANZA_BYTES=8192, MAX_FIELD_LENGTH=4096) == {"relay.E101"}
    assert ids(MAX_STANZA_DEPTH=6) == {"relay.E102"}
    assert ids(LINK_MAX_IN_FLIGHT=0) == {"relay.E103"}


def test_a_lease_renewed_too_seldom_is_an_error():
    """A gateway must be able to miss one renewal before it has to drop its links."""
    assert ids(GATEWAY_LEASE_SECONDS=10.0, GATEWAY_RENEW_SECONDS=3.0) == set()
    assert ids(GATEWAY_LEASE_SECONDS=10.0, GATEWAY_RENEW_SECONDS=4.0) == {"relay.E107"}
    assert ids(GATEWAY_RENEW_SECONDS=0.0) == {"relay.E107"}
