"""Pointing an app at the wire-level provider fakes, and reading raw send jobs off the broker."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pushsite.celery import app as celery_app
from tests.fakes.apns import FakeApns, make_p8_key
from tests.fakes.fcm import FakeFcm
from tests.fakes.wns import FakeWns
from tests.support.broker import QUEUE

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


@dataclass(frozen=True)
class QueuedJob:
    job: dict[str, Any]
    eta: datetime | None


def queued_jobs_with_eta(limit: int = 1000) -> list[QueuedJob]:
    """Take the queued send jobs with their ETA (a delayed send's countdown)."""
    found: list[QueuedJob] = []
    with celery_app.connection_for_read() as conn:
        queue = conn.SimpleQueue(QUEUE)
        try:
            for _ in range(limit):
                try:
                    message = queue.get(block=False)
                except queue.Empty:
                    break
                args, _kwargs, _embed = message.decode()
                eta = message.headers.get("eta")
                found.append(QueuedJob(args[0], datetime.fromisoformat(eta) if eta else None))
                message.ack()
        finally:
            queue.close()
    return found
