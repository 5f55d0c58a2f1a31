"""The services count what they do (relay/metrics.py), and the web process's /metrics and
/readyz show it: publishes by verdict, registrations, sends by provider and outcome with their
latency, retries, dead letters and their replay, the stored state, and no secret in a label.

In one process (the default registry); tests/test_metrics.py scrapes the real processes,
the web's workers added up."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from relay import features, metrics
from relay.models import DeadLetter, Outcome, ProviderCredentials, Registration, Service
from relay.services import dead_letters, delivery, queue, throttling
from relay.services import provider_limits as limits
from relay.services import provider_registry as registry
from relay.services.publishing import Publish, Verdict, accept_publish
from relay.services.registrations import register_device, unregister_device
from tests.fakes.fcm import FakeFcm
from tests.support.processes import ROOT
from tests.support.provider_fakes import configure_fcm

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def fcm():
    with FakeFcm() as fake:
        yield fake


@pytest.fixture
def fcm_app(fcm, component, send_queue):
    fcm.reset()
    configure_fcm(component.app, fcm)
    component.app.save()
    throttling.reset()
    limits.reset()
    yield component
    registry.close_all()
    throttling.reset()
    limits.reset()


def register(component, device: str = "dev-1", token: str = "tok-1") -> Registration:
    answer = register_device(
        component=component,
        service=Service.FCM,
        bare_jid="alice@localhost",
        device_id=device,
        token=token,
    )
    return Registration.objects.get(node=answer.node)


def test_publishes_are_counted_by_tenant_and_verdict(component, send_queue):
    registration = register(component)
    tenant = str(component.tenant_id)
    before = {
        verdict: value("relay_publishes_total", tenant=tenant, verdict=verdict)
        for verdict in ("accepted", "forbidden")
    }
    unknown = value("relay_publishes_total", tenant="", verdict="unknown-node")

    def publish(**changes: object) -> Verdict:
        fields = {
            "component_id": component.pk,
            "publishing_domain": "localhost",
            "node": registration.node,
            "secret": registration.secret,
            "important": True,
        }
        return accept_publish(Publish(**{**fields, **changes}))

    assert publish() is Verdict.ACCEPTED
    assert publish(secret="wrong") is Verdict.FORBIDDEN
    assert publish(node="nope") is Verdict.UNKNOWN_NODE
    assert value("relay_publishes_total", tenant=tenant, verdict="accepted") == (
        before["accepted"] + 1
    )
    assert value("relay_publishes_total", tenant=tenant, verdict="forbidden") == (
        before["forbidden"] + 1
    )
    assert value("relay_publishes_total", tenant="", verdict="unknown-node") == unknown + 1


def test_registrations_are_counted_by_result(component):
    tenant = str(component.tenant_id)
    counts = {
        result: value("relay_registration_requests_total", tenant=tenant, result=result)
        for result in ("created", "renewed", "unregistered")
    }
    register(component)
    register(component, token="tok-2")  # the same device with a new token
    unregister_device(
        component=component, service=Service.FCM, bare_jid="alice@localhost", device_id="dev-1"
    )
    for result in counts:
        assert value("relay_registration_requests_total", tenant=tenant, result=result) == (
            counts[result] + 1
        ), result


def job_for(registration: Registration, **changes: object) -> queue.SendJob:
    now = timezone.now()
    job = queue.SendJob(
        push_id=str(uuid.uuid4()),
        registration_id=registration.pk,
        publishing_domain="localhost",
        important=True,
        received=(now - timedelta(seconds=2)).isoformat(),
        queued=now.isoformat(),
    )
    return dataclasses.replace(job, **changes)


def test_sends_latency_retries_and_dead_letters_are_counted(fcm, fcm_app):
    component = fcm_app
    sent = {
        outcome: value("relay_sends_total", provider="fcm", outcome=outcome)
        for outcome in ("delivered", "retry_later", "failed")
    }
    latency = value("relay_push_latency_seconds_count", provider="fcm")
    latency_over_1s = value("relay_push_latency_seconds_bucket", provider="fcm", le="1.0")
    durations = value("relay_send_duration_seconds_count", provider="fcm")
    retries = value("relay_send_retries_total", provider="fcm", kind="error")
    letters = value("relay_dead_letters_total", provider="fcm", kind="failed")
    replayed = value("relay_dead_letters_replayed_total")

    delivered = register(component, "dev-a", "tok-a")
    assert delivery.deliver(job_for(delivered)) == Outcome.DELIVERED
    retried = register(component, "dev-b", "tok-b")
    fcm.respond("tok-b", 503)
    assert delivery.deliver(job_for(retried)) == Outcome.RETRY_LATER
    failing = register(component, "dev-c", "tok-c")
    fcm.respond("tok-c", 403)
    failed_job = job_for(failing)
    assert delivery.deliver(failed_job) == Outcome.FAILED

    for outcome in sent:
        assert value("relay_sends_total", provider="fcm", outcome=outcome) == sent[outcome] + 1
    # The delivered push was published two seconds before: in the latency, above 1 s.
    assert value("relay_push_latency_seconds_count", provider="fcm") == latency + 1
    assert value("relay_push_latency_seconds_bucket", provider="fcm", le="1.0") == (latency_over_1s)
    assert value("relay_send_duration_seconds_count", provider="fcm") == durations + 3
    assert value("relay_sends_in_flight", provider="fcm") == 0
    assert value("relay_send_retries_total", provider="fcm", kind="error") == retries + 1
    assert value("relay_dead_letters_total", provider="fcm", kind="failed") == letters + 1

    letter = DeadLetter.objects.get(push_id=failed_job.push_id)
    assert dead_letters.replay(dead_letter_ids=[letter.pk]) == 1
    assert value("relay_dead_letters_replayed_total") == replayed + 1


def test_in_flight_counts_wake_ups_while_the_provider_answers():
    with metrics.sending("wns", 3):
        assert value("relay_sends_in_flight", provider="wns") == 3
    assert value("relay_sends_in_flight", provider="wns") == 0


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("retries exhausted: HTTP_500", "exhausted"),
        ("too old: not sent", "too-old"),
        ("not re-queued: HTTP_503", "not-requeued"),
        ("failed: SENDER_ID_MISMATCH", "failed"),
    ],
)
def test_dead_letter_reasons_become_bounded_kinds(reason, kind):
    assert metrics.dead_letter_kind(reason) == kind


def scrape(client, **headers: str) -> dict[str, list]:
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.status_code
    assert response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)} | {
        "_text": text
    }  # type: ignore[dict-item]


def test_web_metrics_show_the_stored_state_without_secrets(client, fcm_app):
    component = fcm_app
    alive = register(component, "dev-1", "tok-secret-1")
    dead = register(component, "dev-2", "tok-secret-2")
    Registration.objects.filter(pk=dead.pk).update(dead_since=timezone.now())
    ProviderCredentials.objects.create(
        app_id=component.app_id,
        service="apns",
        values="{}",
        not_after=timezone.now() + timedelta(days=10),
    )
    DeadLetter.objects.create(
        push_id=str(uuid.uuid4()),
        tenant_id=component.tenant_id,
        app_id=component.app_id,
        registration_id=alive.pk,
        provider="fcm",
        reason="failed: X",
        attempts=1,
        job={},
    )

    families = scrape(client)
    app = {"tenant": "example", "app": "conversations"}
    registrations = {
        sample.labels["state"]: sample.value
        for sample in families["relay_registrations"]
        if sample.labels == {**app, "provider": "fcm", "state": sample.labels["state"]}
    }
    assert registrations == {"live": 1, "dead": 1}
    [expiry] = families["relay_credential_expiry_seconds"]
    assert expiry.labels == {**app, "credential": "apns_certificate"}
    assert 9 * 86400 < expiry.value <= 10 * 86400
    [pending] = families["relay_dead_letters_pending"]
    assert pending.labels == {**app, "provider": "fcm"} and pending.value == 1
    assert [sample.value for sample in families["relay_queue_depth"]] == [0]
    assert {s.labels["source"]: s.value for s in families["relay_state_up"]} == {
        "database": 1,
        "broker": 1,
    }
    # Counters of this process are there too; no JID, token, node or secret anywhere.
    assert "relay_sends" in families
    text = families["_text"]
    for secret in ("tok-secret", alive.node, alive.secret, "alice", "localhost"):
        assert secret not in text, secret


def test_web_metrics_show_the_feature_apps_gauges(client, fcm_app):
    """The feature apps' gauges (relay.features: state_metrics) are read with the core's."""
    from relay.unifiedpush.models import UnifiedPushMessage
    from relay.windows.models import WnsDevice

    component = fcm_app
    for n in range(2):
        WnsDevice.objects.create(
            app_id=component.app_id,
            device_id_hash=f"{n}" * 64,
            channel_uri="https://db5.notify.windows.com/?token=secret",
        )
    now = timezone.now()
    UnifiedPushMessage.objects.create(
        tenant_id=component.tenant_id, component=component, endpoint_key="e", recipient_key="r",
        received=now, expires=now, endpoint_expires=now, next_attempt=now, size=1, ttl=60,
        sealed=b"x",
    )  # fmt: skip
    families = scrape(client)
    assert features.state_gauge_names() == {
        "relay_unifiedpush_stored_messages",
        "relay_windows_devices",
    }
    [devices] = families["relay_windows_devices"]
    assert devices.labels == {"tenant": "example", "app": "conversations"}
    assert devices.value == 2
    [stored] = families["relay_unifiedpush_stored_messages"]
    assert stored.labels == {"tenant": "example"} and stored.value == 1
    assert "secret" not in families["_text"]


def test_the_metrics_token_is_required_once_set(client):
    with override_settings(RELAY={**settings.RELAY, "METRICS_TOKEN": "scrape-me"}):
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
        assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").status_code == 200


def test_web_readiness_checks_database_broker_throttling_store_and_cache(client):
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"] == {
        "database": True,
        "broker": True,
        "throttling": True,
        "cache": True,
    }


def test_web_readiness_fails_when_the_throttling_store_is_unreachable(client, tmp_path):
    # A state URL whose file cannot be opened: the store does not answer.
    with override_settings(
        RELAY={**settings.RELAY, "STATE_URL": f"sqlite:///{tmp_path}/missing/dir/state.db"}
    ):
        response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["throttling"] is False


@pytest.mark.parametrize(
    ("path", "handler"),
    [
        ("/api/v1/apps/KEY/uwpx", "api"),
        ("/push/v4.local.secret-token", "push"),
        ("/push/message/ref", "push"),
        ("/_matrix/push/v1/notify", "matrix"),
        ("/admin/relay/app/", "admin"),
        ("/metrics", "probe"),
        ("/static/admin/base.css", "static"),
        ("/anything/else", "other"),
    ],
)
def test_http_handlers_are_bounded_names_not_paths(path, handler):
    assert metrics.http_handler(path) == handler


def test_every_request_is_counted_by_handler_and_status():
    before = value("relay_http_requests_total", handler="push", method="POST", status="404")
    other = value("relay_http_requests_total", handler="push", method="other", status="404")
    metrics.count_request("/push/v4.local.x", "POST", 404, 0.01)
    metrics.count_request("/push/v4.local.y", "BREW", 404, 0.01)
    assert value("relay_http_requests_total", handler="push", method="POST", status="404") == (
        before + 1
    )
    assert value("relay_http_requests_total", handler="push", method="other", status="404") == (
        other + 1
    )


def test_the_dashboard_uses_every_metric_and_no_other():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "relay.json").read_text())
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    used = {
        re.sub(r"_(total|bucket|count|sum)$", "", name)
        for expr in expressions
        for name in re.findall(r"\brelay_[a-z_]+", expr)
    }
    defined = (
        {
            collector._name  # type: ignore[attr-defined]
            for collector in vars(metrics).values()
            if isinstance(collector, MetricWrapperBase)
        }
        | set(metrics.STATE_GAUGES)
        | features.state_gauge_names()
    )
    assert used == defined


@pytest.mark.parametrize(
    ("listen", "errors"),
    [("127.0.0.1:9101", 0), ("", 0), ("[::1]:0", 0), ("9101", 1), ("host:port", 1)],
)
def test_a_probe_address_that_cannot_be_parsed_is_a_system_check_error(listen, errors):
    from relay.checks import probe_listen_check

    with override_settings(RELAY={**settings.RELAY, "GATEWAY_PROBE_LISTEN": listen}):
        found = [message.id for message in probe_listen_check()]
    assert found == ["relay.E120"] * errors
