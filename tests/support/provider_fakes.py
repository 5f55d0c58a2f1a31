"""Pointing an app at the wire-level provider fakes, and reading raw send jobs off the broker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fakes.apns import FakeApns, make_p8_key
from tests.fakes.fcm import FakeFcm
from tests.fakes.wns import FakeWns

APNS_TOPIC = "org.example.relay"


def configure_fcm(app: Any, fake: FakeFcm) -> None:
    app.fcm_service_account = json.dumps(fake.service_account())
    app.fcm_endpoint = fake.url


def start_apns() -> tuple[FakeApns, str]:
    """A started fake APNs checking ES256 provider tokens, and the .p8 key it trusts."""
    key_pem, public_key = make_p8_key()
    return FakeApns(topic=APNS_TOPIC, public_key=public_key).start(), key_pem


def configure_apns(app: Any, fake: FakeApns, key_pem: str) -> None:
    app.apns_topic = fake.topic
    app.apns_key = key_pem
    app.apns_key_id = fake.key_id
    app.apns_team_id = fake.team_id
    app.apns_endpoint = fake.endpoint
    app.apns_ca_certificate = Path(fake.ca_file).read_text()


def configure_wns(app: Any, fake: FakeWns) -> None:
    app.wns_package_sid = fake.client_id
    app.wns_secret = fake.client_secret
    app.wns_token_url = fake.token_url
    app.wns_channel_hosts = fake.host_pattern
