"""The Web Push provider against a fake push service that checks the VAPID JWT and decrypts
every message with the subscription's private key, as a browser would."""

from __future__ import annotations

import json
import socket
import uuid

import pytest

from relay.models import App, Tenant
from relay.providers.base import Outcome, SendResult, Wakeup
from relay.providers.registry import spec_for
from relay.providers.webpush import (
    WebPushConfig,
    WebPushProvider,
    endpoint_allowed,
    new_private_key,
    parse_token,
    public_key,
    subscription,
)
from relay.services import channels
from relay.services import provider_registry as registry
from tests.fakes.webpush import FakePushService, FakeReply, FakeSubscription, b64encode
from tests.support.provider_fakes import configure
from tests.support.tls import loopback_tls

pytestmark = pytest.mark.defaults

SUBJECT = "mailto:ops@example.org"
ACCOUNT = "a" * 40


@pytest.fixture(scope="module")
def private_key() -> str:
    return new_private_key()


@pytest.fixture
def fake():
    with FakePushService() as service:
        yield service


def provider_for(
    fake: FakePushService, private_key: str, *, timeout: float = 5.0, **options
) -> WebPushProvider:
    config = WebPushConfig(
        private_key=private_key, subject=SUBJECT, endpoint_hosts=(fake.host_pattern,), **options
    )
    return WebPushProvider(config, timeout=timeout)


def wakeup(sub: FakeSubscription, *, important: bool = True, channel: str = "") -> Wakeup:
    return Wakeup(
        push_id=str(uuid.uuid4()),
        token=sub.token(),
        account=ACCOUNT,
        channel=channel,
        important=important,
    )


@pytest.fixture(params=["lone", "batch"])
def send(request):
    """A wake-up sent alone (requests, in this thread) or as a batch (aiohttp, on the
    provider loop): the same request on the wire, the same classification."""
    if request.param == "lone":
        return lambda provider, w: provider.send(w)
    return lambda provider, w: provider.send_many([w])[0]


def test_an_important_wakeup_arrives_encrypted_with_a_valid_vapid_jwt(fake, private_key, send):
    provider = provider_for(fake, private_key)
    sub = fake.subscribe()
    result = send(provider, wakeup(sub))
    assert result.outcome == Outcome.DELIVERED, (result, fake.refusals)
    [message] = fake.received_for(sub)
    assert message.payload() == {"account": ACCOUNT, "priority": "high"}
    assert message.headers["content-encoding"] == "aes128gcm"
    assert message.headers["urgency"] == "high"
    assert message.headers["ttl"] == "86400"
    assert "topic" not in message.headers
    assert message.claims["aud"] == fake.origin and message.claims["sub"] == SUBJECT
    assert message.vapid_key == public_key(private_key)
    assert ACCOUNT.encode() not in message.headers.get("authorization", "").encode()
    provider.close()


def test_a_silent_wakeup_for_a_room_is_normal_urgency_and_carries_the_room(fake, private_key, send):
    provider = provider_for(fake, private_key, ttl=600, topic=True)
    sub = fake.subscribe()
    assert send(provider, wakeup(sub, important=False, channel="b" * 40)).outcome == (
        Outcome.DELIVERED
    )
    [message] = fake.received_for(sub)
    assert message.payload() == {"account": ACCOUNT, "priority": "normal", "channel": "b" * 40}
    assert message.headers["urgency"] == "normal"
    assert message.headers["ttl"] == "600"
    topic = message.headers["topic"]
    assert len(topic) <= 32 and ACCOUNT not in topic
    # The same account and room collapse under the same topic.
    send(provider, wakeup(sub, important=False, channel="b" * 40))
    assert fake.received_for(sub)[1].headers["topic"] == topic
    provider.close()


def test_one_jwt_serves_many_sends_to_one_push_service(fake, private_key):
    provider = provider_for(fake, private_key)
    subs = [fake.subscribe() for _ in range(3)]
    for sub in subs:
        assert provider.send(wakeup(sub)).outcome == Outcome.DELIVERED
    assert len({message.headers["authorization"] for message in fake.received}) == 1
    provider.close()


@pytest.mark.parametrize(
    ("reply", "outcome", "code", "retry_after"),
    [
        (FakeReply(404), Outcome.DEAD_TOKEN, "HTTP_404", None),
        (FakeReply(410), Outcome.DEAD_TOKEN, "HTTP_410", None),
        (FakeReply(413), Outcome.FAILED, "HTTP_413", None),
        (FakeReply(400), Outcome.FAILED, "HTTP_400", None),
        (FakeReply(429, {"Retry-After": "7"}), Outcome.RETRY_LATER, "HTTP_429", 7.0),
        (FakeReply(503, {"Retry-After": "30"}), Outcome.RETRY_LATER, "HTTP_503", 30.0),
        (FakeReply(500), Outcome.RETRY_LATER, "HTTP_500", None),
    ],
    ids=["404", "410", "413", "400", "429", "503", "500"],
)
def test_answers_are_classified(fake, private_key, send, reply, outcome, code, retry_after):
    provider = provider_for(fake, private_key)
    sub = fake.subscribe()
    fake.script(sub, reply)
    result = send(provider, wakeup(sub))
    assert (result.outcome, result.error_code, result.retry_after) == (outcome, code, retry_after)
    provider.close()


def test_a_message_encrypted_to_other_keys_is_refused_by_the_service(fake, private_key, send):
    """The fake really decrypts: keys that do not belong to the endpoint make a 400."""
    provider = provider_for(fake, private_key)
    sub, other = fake.subscribe(), fake.subscribe()
    mixed = Wakeup(
        push_id="p",
        token=subscription(sub.endpoint, other.p256dh, other.auth).token(),
        account=ACCOUNT,
    )
    assert send(provider, mixed).error_code == "HTTP_400"
    assert [(sub_id, status) for sub_id, status, _ in fake.refusals] == [(sub.id, 400)]
    provider.close()


def test_an_endpoint_off_the_allowed_hosts_is_not_sent_to(fake, private_key, send):
    config = WebPushConfig(
        private_key=private_key, subject=SUBJECT, endpoint_hosts=("*.push.example.org",)
    )
    provider = WebPushProvider(config)
    sub = fake.subscribe()
    assert send(provider, wakeup(sub)).error_code == "ENDPOINT_NOT_ALLOWED"
    # No hosts: any public https host, never loopback or a private address.
    provider = WebPushProvider(WebPushConfig(private_key=private_key, subject=SUBJECT))
    assert send(provider, wakeup(sub)).error_code == "ENDPOINT_NOT_ALLOWED"
    assert fake.received == []
    assert endpoint_allowed("https://updates.push.services.mozilla.com/wpush/v2/x", ())
    assert endpoint_allowed("https://fcm.googleapis.com/fcm/send/x", ())
    for refused in (
        "http://push.example.org/x",
        "https://127.0.0.1/x",
        "https://10.1.2.3/x",
        "https://[::1]/x",
        "https://localhost/x",
        "https://user@push.example.org/x",
    ):
        assert not endpoint_allowed(refused, ()), refused


def test_timeouts_and_refused_connections_are_retried_later(fake, private_key, send):
    provider = provider_for(fake, private_key, timeout=0.3)
    sub = fake.subscribe()
    fake.script(sub, FakeReply(201, delay=10))
    assert send(provider, wakeup(sub)).error_code == "TIMEOUT"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    gone = subscription(f"http://127.0.0.1:{port}/push/x", sub.p256dh, sub.auth)
    result = send(provider, Wakeup(push_id="p", token=gone.token(), account=ACCOUNT))
    assert (result.outcome, result.error_code) == (Outcome.RETRY_LATER, "NETWORK")
    provider.close()


def test_a_redirect_is_not_followed(fake, private_key, send):
    """The endpoint is what the allow-list checked: a push service's redirect is an answer,
    not somewhere else to send the wake-up."""
    provider = provider_for(fake, private_key)
    sub, elsewhere = fake.subscribe(), fake.subscribe()
    fake.script(sub, FakeReply(307, {"Location": elsewhere.endpoint}))
    result = send(provider, wakeup(sub))
    assert (result.outcome, result.error_code) == (Outcome.FAILED, "HTTP_307")
    assert fake.received_for(elsewhere) == [] and fake.refusals == []
    provider.close()


def test_a_batch_is_classified_as_its_sends_one_by_one(fake, private_key):
    provider = provider_for(fake, private_key)
    gone, busy, fine = fake.subscribe(), fake.subscribe(), fake.subscribe()
    fake.script(gone, FakeReply(410), FakeReply(410))
    fake.script(busy, FakeReply(429, {"Retry-After": "7"}), FakeReply(429, {"Retry-After": "7"}))
    junk = Wakeup(push_id="j", token="not json", account=ACCOUNT)
    batch = [wakeup(gone), junk, wakeup(busy), wakeup(fine)]

    one_by_one = [provider.send(w) for w in batch]
    together = provider.send_many(batch)

    assert together == one_by_one
    assert [(r.outcome, r.error_code) for r in together] == [
        (Outcome.DEAD_TOKEN, "HTTP_410"),
        (Outcome.DEAD_TOKEN, "BAD_SUBSCRIPTION"),
        (Outcome.RETRY_LATER, "HTTP_429"),
        (Outcome.DELIVERED, ""),
    ]
    assert len(fake.received_for(fine)) == 2
    provider.close()


def test_a_batch_is_sent_side_by_side(fake, private_key):
    provider = provider_for(fake, private_key, timeout=5.0)
    subs = [fake.subscribe() for _ in range(4)]
    for sub in subs:
        fake.script(sub, FakeReply(201, delay=1.0))

    results = provider.send_many([wakeup(sub) for sub in subs])

    assert [r.outcome for r in results] == [Outcome.DELIVERED] * 4
    answered = [message.received_at for message in fake.received]
    assert len(answered) == 4
    assert max(answered) - min(answered) < 1.0  # each taken before the first was answered
    provider.close()


def test_a_closed_provider_sends_nothing_and_answers_retry_later(fake, private_key, send):
    provider = provider_for(fake, private_key)
    provider.close()
    result = send(provider, wakeup(fake.subscribe()))
    assert (result.outcome, result.error_code) == (Outcome.RETRY_LATER, "CLOSED")
    assert fake.received == []


def test_a_token_that_is_no_subscription_is_a_dead_token(private_key):
    provider = WebPushProvider(WebPushConfig(private_key=private_key, subject=SUBJECT))
    result = provider.send(Wakeup(push_id="p", token="not json", account=ACCOUNT))
    assert (result.outcome, result.error_code) == (Outcome.DEAD_TOKEN, "BAD_SUBSCRIPTION")


def test_the_registration_fields_make_the_token_or_say_what_is_wrong(fake):
    spec = spec_for("webpush")
    sub = fake.subscribe()
    token = spec.registration.token(sub.fields())
    assert parse_token(token) == subscription(sub.endpoint, sub.p256dh, sub.auth)
    assert json.loads(token) == {
        "endpoint": sub.endpoint,
        "keys": {"p256dh": sub.p256dh, "auth": sub.auth},
    }
    for change, words in (
        ({"endpoint": ""}, "endpoint is required"),
        ({"p256dh": b64encode(b"\x04" + b"\x01" * 64)}, "P-256"),
        ({"p256dh": "%%%"}, "p256dh"),
        ({"auth": b64encode(b"short")}, "16-byte"),
        ({"endpoint": "https://x/" + "a" * 3000}, "at most 2048"),
    ):
        with pytest.raises(ValueError) as refused:
            spec.registration.token({**sub.fields(), **change})
        assert words in str(refused.value), (change, refused.value)
        assert sub.auth not in str(refused.value)


def test_the_spec_validates_the_vapid_key_contact_ttl_and_hosts(private_key):
    spec = spec_for("webpush")
    good = {"private_key": private_key, "subject": SUBJECT}
    assert spec.validate(spec.complete(good)) == {}
    assert spec.validate(spec.complete({})) == {}  # not configured: nothing to complain of
    from tests.fakes.apns import make_p8_key
    from tests.fakes.fcm import new_private_key_pem

    for change, field in (
        ({"private_key": new_private_key_pem()}, "private_key"),  # RSA
        (
            {"private_key": "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----"},
            "private_key",
        ),
        ({"subject": "ops@example.org"}, "subject"),
        ({"ttl": "a day"}, "ttl"),
        ({"ttl": str(40 * 86400)}, "ttl"),
        ({"endpoint_hosts": "*"}, "endpoint_hosts"),
    ):
        assert field in spec.validate(spec.complete({**good, **change})), change
    assert spec.validate(spec.complete({**good, "private_key": make_p8_key()[0]})) == {}
    generated = spec.generate() if spec.generate else {}
    assert spec.validate(spec.complete({**good, **generated})) == {}


@pytest.mark.django_db
def test_the_registry_builds_it_from_the_apps_record_and_registration_checks_hosts(
    fake, private_key
):
    app = App.objects.create(tenant=Tenant.objects.create(name="web"), name="browser")
    configure(app, "webpush", private_key=private_key, subject=SUBJECT)
    sub = fake.subscribe()
    # No hosts configured: only public https hosts, so the fake's loopback endpoint is refused
    # at registration, with a reason that does not echo the endpoint.
    with pytest.raises(channels.ChannelRefused) as refused:
        channels.check_sendable(app_id=app.pk, service="webpush", token=sub.token())
    assert sub.endpoint not in str(refused.value) and "public host" in str(refused.value)
    configure(
        app, "webpush", private_key=private_key, subject=SUBJECT, endpoint_hosts=fake.host_pattern
    )
    channels.check_sendable(app_id=app.pk, service="webpush", token=sub.token())
    provider = registry.provider_for(App.objects.get(pk=app.pk), "webpush")
    try:
        assert provider.send(wakeup(sub)).outcome == Outcome.DELIVERED
    finally:
        registry.close_all()
    assert fake.received_for(sub)[0].vapid_key == public_key(private_key)


# --- the admin and YAML, from the spec ---------------------------------------------------------


@pytest.mark.django_db
def test_the_admin_generates_a_vapid_key_pair_and_keeps_it(private_key):
    from relay.forms import AppForm
    from relay.services.credentials import records, selectors

    tenant = Tenant.objects.create(name="web")
    data = {
        "tenant": str(tenant.pk),
        "name": "browser",
        "public_key": "pk-browser",
        "payload_options": "{}",
        "webpush_subject": SUBJECT,
        "webpush_endpoint_hosts": "*.push.services.mozilla.com",
    }
    form = AppForm(data={**data, "webpush_generate": "on"})
    assert form.is_valid(), form.errors
    app = form.save()
    stored = records.values_of(App.objects.get(pk=app.pk), "webpush")
    assert "PRIVATE KEY" in stored["private_key"] and stored["subject"] == SUBJECT
    lines = dict(selectors.credential_summary(app=App.objects.get(pk=app.pk)))
    assert lines["Web Push VAPID public key"] == public_key(stored["private_key"])
    html = str(AppForm(instance=App.objects.get(pk=app.pk)))
    assert stored["private_key"].splitlines()[1] not in html

    # Saving again without "generate" keeps the key; with a bad contact it is refused.
    form = AppForm(data={**data, "webpush_ttl": "600"}, instance=App.objects.get(pk=app.pk))
    assert form.is_valid(), form.errors
    form.save()
    again = records.values_of(App.objects.get(pk=app.pk), "webpush")
    assert (again["private_key"], again["ttl"]) == (stored["private_key"], "600")
    form = AppForm(
        data={**data, "webpush_subject": "ops@example.org"}, instance=App.objects.get(pk=app.pk)
    )
    assert not form.is_valid()
    assert "mailto:" in str(form.errors["webpush_subject"])


@pytest.mark.django_db
def test_yaml_provisions_a_vapid_key_from_a_file(tmp_path, private_key):
    from relay.services.credentials import records
    from relay.services.provisioning import ProvisioningError, load_tenants

    (tmp_path / "vapid.pem").write_text(private_key)
    document = """
tenants:
  - name: web
    apps:
      - name: browser
        webpush:
          private_key_file: vapid.pem
          subject: mailto:ops@example.org
          endpoint_hosts: ["*.push.services.mozilla.com", "fcm.googleapis.com"]
          ttl: 600
          topic: true
"""
    assert load_tenants(document, base_dir=tmp_path).counts["app created"] == 1
    stored = records.values_of(App.objects.get(name="browser"), "webpush")
    assert stored == {
        "private_key": private_key.strip(),
        "subject": SUBJECT,
        "endpoint_hosts": "*.push.services.mozilla.com\nfcm.googleapis.com",
        "ttl": "600",
        "topic": True,
    }
    assert load_tenants(document, base_dir=tmp_path).counts["app unchanged"] == 1
    with pytest.raises(ProvisioningError) as refused:
        load_tenants(document.replace("mailto:ops@example.org", "ops"), base_dir=tmp_path)
    assert str(refused.value).startswith("tenants[0].apps[0].webpush.subject: The contact")
    with pytest.raises(ProvisioningError) as refused:
        load_tenants(
            document.replace("          private_key_file: vapid.pem\n", ""), base_dir=tmp_path
        )
    assert str(refused.value) == "tenants[0].apps[0].webpush.private_key_file: required"


def test_an_https_push_service_is_trusted_through_the_ca_bundle_both_ways(tmp_path, private_key):
    """A push service over TLS, verified against the operator's CA bundle (REQUESTS_CA_BUNDLE)
    by a lone send (requests) and a batch (aiohttp) alike: delivered with the bundle of the
    throw-away CA that signed its certificate, refused (NETWORK, nothing received) with
    certifi's."""
    server, bundle = loopback_tls(tmp_path, "fake push service CA")
    with FakePushService(tls=server) as fake:
        config = WebPushConfig(
            private_key=private_key, subject=SUBJECT, endpoint_hosts=(fake.host_pattern,)
        )
        trusted = WebPushProvider(config, timeout=5.0, ca_bundle=str(bundle))
        untrusted = WebPushProvider(config, timeout=5.0)
        try:
            subs = [fake.subscribe() for _ in range(3)]
            assert fake.origin.startswith("https://")
            assert trusted.send(wakeup(subs[0])).outcome == Outcome.DELIVERED
            together = trusted.send_many([wakeup(sub) for sub in subs[1:]])
            assert [r.outcome for r in together] == [Outcome.DELIVERED] * 2
            refused = SendResult(Outcome.RETRY_LATER, "NETWORK")
            assert untrusted.send(wakeup(subs[0])) == refused
            assert untrusted.send_many([wakeup(sub) for sub in subs[1:]]) == [refused] * 2
            assert len(fake.received) == 3
        finally:
            trusted.close()
            untrusted.close()
