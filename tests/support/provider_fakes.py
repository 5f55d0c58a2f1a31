"""Pointing an app at the wire-level provider fakes, and reading raw send jobs off the broker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fakes.apns import FakeApns, make_p8_key
from tests.fakes.fcm import FakeFcm
from tests.fakes.wns import FakeWns

APNS_TOPIC = "org.example.relay"


def configure(app: Any, service: str, **values: Any) -> None:
    """Store the app's credentials record for `service` (what the admin and YAML write)."""
    # Imported here: tests/support/fault_lab.py's helper process imports this module before
    # django.setup(), and the records import the models.
    from relay.services.credentials import records

    records.store(app, service, values)


def configure_fcm(app: Any, fake: FakeFcm) -> None:
    configure(app, "fcm", service_account=json.dumps(fake.service_account()), endpoint=fake.url)


def start_apns() -> tuple[FakeApns, str]:
    """A started fake APNs checking ES256 provider tokens, and the .p8 key it trusts."""
    key_pem, public_key = make_p8_key()
    return FakeApns(topic=APNS_TOPIC, public_key=public_key).start(), key_pem


def configure_apns(app: Any, fake: FakeApns, key_pem: str) -> None:
    configure(
        app,
        "apns",
        topic=fake.topic,
        key=key_pem,
        key_id=fake.key_id,
        team_id=fake.team_id,
        endpoint=fake.endpoint,
        ca_certificate=Path(fake.ca_file).read_text(),
    )


def configure_wns(app: Any, fake: FakeWns) -> None:
    configure(
        app,
        "wns",
        package_sid=fake.client_id,
        secret=fake.client_secret,
        token_url=fake.token_url,
        channel_hosts=fake.host_pattern,
    )


def change_credentials(app: Any, service: str, **changes: Any) -> None:
    from relay.services.credentials import records

    """Change some fields of the app's stored credentials for `service`, keeping the rest."""
    records.forget(app)
    records.store(app, service, {**records.values_of(app, service), **changes})
