"""The Windows (UWPX-style) JSON API: the seed's messages, storage, every validation error,
rate limits, test pushes, stale devices and the served OpenAPI schema and docs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from relay.models import App, Component, Registration, Service, Tenant
from relay.services.publishing import Publish, Verdict, accept_publish
from relay.windows import services as uwpx
from relay.windows.models import WnsDevice
from tests.support.processes import ROOT
from tests.support.provider_fakes import change_credentials
from tests.uwpx_examples import (
    SEED_ERROR,
    SEED_SET_ACCOUNTS,
    SEED_SET_ACCOUNTS_SUCCESS,
    SEED_SET_CHANNEL_URI,
    SEED_SUCCESS,
)

pytestmark = [pytest.mark.django_db]

DEVICE_ID = "5486bd868050a620141f4e81c9f1d2c67ab0de27e5e26d218ca41c9394ee806b"
OTHER_DEVICE = "0123456789abcdef" * 4
CHANNEL = "https://db5p.notify.windows.com/?token=AwYAAAD8sXKQxmVlUmNhQ%2bjNMKn6"
VECTOR = "e5397e96c6ff4d629ab9f203eec3ff17c777b2127cf1b41005e54877487ba982"

ERROR_KEYS = {"version", "action", "status", "error"}


def lenient_json(text: str) -> dict:
    return json.loads(re.sub(r",(\s*[}\]])", r"\1", text))


@pytest.fixture(autouse=True)
def own_rate_limit_counters(settings):
    """Each test counts in a cache of its own."""
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "LOCATION": f"uwpx-{uuid.uuid4()}",
        }
    }


@pytest.fixture
def app(component) -> App:
    return component.app


def url(app: App, action: str = "") -> str:
    return f"/api/v1/apps/{app.public_key}/uwpx" + (f"/{action}" if action else "")


def post(client, app, body, action: str = "", **extra):
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return client.post(url(app, action), data=data, content_type="application/json", **extra)


def channel_message(device_id: str = DEVICE_ID, channel: str = CHANNEL) -> dict:
    return {
        "version": 1,
        "action": "set_channel_uri",
        "device_id": device_id,
        "channel_uri": channel,
    }


def accounts_message(*jids: str, device_id: str = DEVICE_ID, action="set_accounts") -> dict:
    return {
        "version": 1,
        "action": action,
        "device_id": device_id,
        "accounts": [{"bare_jid": jid} for jid in jids],
    }


def register(client, app, *jids: str, device_id: str = DEVICE_ID) -> dict:
    assert post(client, app, channel_message(device_id)).status_code == 200
    response = post(client, app, accounts_message(*jids, device_id=device_id))
    assert response.status_code == 200, response.content
    return response.json()


def assert_error(response, status: int, *fragments: str) -> str:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == ERROR_KEYS
    assert (body["version"], body["action"], body["status"]) == (1, "response", 0)
    for fragment in fragments:
        assert fragment in body["error"]
    return body["error"]


# --- the seed's examples ------------------------------------------------------------------------


@pytest.mark.defaults
def test_seed_set_channel_uri_is_parsed_and_its_package_sid_refused(client, app):
    # The seed's "channel_uri" is the app's package SID, not a channel: nothing may be sent there.
    error = assert_error(post(client, app, SEED_SET_CHANNEL_URI), 422, "channel_uri")
    assert "notify.windows.com" in error
    assert set(json.loads(SEED_ERROR)) == ERROR_KEYS
    assert not WnsDevice.objects.exists()


@pytest.mark.defaults
def test_seed_messages_give_the_seed_answers(client, app, component):
    message = json.loads(SEED_SET_CHANNEL_URI) | {"channel_uri": CHANNEL}
    response = post(client, app, message)
    assert response.status_code == 200
    assert response.json() == json.loads(SEED_SUCCESS)

    response = post(client, app, SEED_SET_ACCOUNTS)
    assert response.status_code == 200
    body = response.json()
    seed = lenient_json(SEED_SET_ACCOUNTS_SUCCESS)
    assert set(seed) <= set(body)
    assert (body["version"], body["action"], body["status"]) == (1, "response", 1)
    assert body["push_bare_jid"] == component.jid
    assert [a["bare_jid"] for a in body["accounts"]] == [a["bare_jid"] for a in seed["accounts"]]
    for account in body["accounts"]:
        assert set(seed["accounts"][0]) <= set(account)
        assert account["node"] and account["secret"] and account["success"] is True
    # The account id is docs/protocols.md 3.2's hash: the same value every WNS push carries.
    assert body["accounts"][0]["account_id"] == VECTOR


@pytest.mark.defaults
def test_storage_holds_hashes_and_domains_never_the_jid_or_device_id(client, app, component):
    body = register(client, app, "someClient@xmpp.uwpx.org")
    registration = Registration.objects.get()
    assert registration.service == Service.WNS
    assert registration.device_hash == VECTOR
    assert registration.account_domain == "xmpp.uwpx.org"
    assert registration.token == CHANNEL
    assert registration.component == component
    assert (registration.node, registration.secret) == (
        body["accounts"][0]["node"],
        body["accounts"][0]["secret"],
    )
    device = WnsDevice.objects.get()
    assert registration.wns_account.device == device
    assert device.device_id_hash == uwpx.device_id_hash(DEVICE_ID)
    stored = json.dumps(
        [
            list(Registration.objects.values().get().values()),
            list(WnsDevice.objects.values().get().values()),
        ],
        default=str,
    )
    assert "someClient" not in stored and DEVICE_ID not in stored


@pytest.mark.defaults
def test_set_push_accounts_is_the_same_action(client, app):
    assert post(client, app, channel_message()).status_code == 200
    response = post(client, app, accounts_message("a@example.org", action="set_push_accounts"))
    assert response.status_code == 200
    assert [a["bare_jid"] for a in response.json()["accounts"]] == ["a@example.org"]


@pytest.mark.defaults
@pytest.mark.parametrize("action", ["set_accounts", "set_push_accounts"])
def test_per_action_url_takes_the_same_body(client, app, action):
    assert post(client, app, channel_message(), "set_channel_uri").json()["status"] == 1
    response = post(client, app, accounts_message("a@example.org", action=action), "set_accounts")
    assert response.status_code == 200
    assert response.json()["accounts"][0]["bare_jid"] == "a@example.org"


# --- storage rules (docs/protocols.md 3.2) ------------------------------------------------------


@pytest.mark.defaults
def test_the_list_replaces_the_old_one_and_kept_accounts_keep_node_and_secret(client, app):
    first = register(client, app, "a@example.org", "b@example.org")
    second = post(client, app, accounts_message("b@example.org", "c@example.org")).json()
    before = {a["bare_jid"]: (a["node"], a["secret"]) for a in first["accounts"]}
    after = {a["bare_jid"]: (a["node"], a["secret"]) for a in second["accounts"]}
    assert after["b@example.org"] == before["b@example.org"]
    assert after["c@example.org"] not in before.values()
    assert Registration.objects.count() == 2
    assert not Registration.objects.filter(device_hash=first["accounts"][0]["account_id"]).exists()


@pytest.mark.defaults
def test_an_empty_list_turns_push_off(client, app, component):
    register(client, app, "a@example.org")
    response = post(client, app, accounts_message())
    assert response.status_code == 200
    assert response.json()["accounts"] == []
    assert response.json()["push_bare_jid"] == component.jid
    assert not Registration.objects.exists()
    assert WnsDevice.objects.exists()


@pytest.mark.defaults
def test_the_same_account_twice_counts_once(client, app):
    body = register(client, app, "a@example.org", "a@example.org")
    assert len(body["accounts"]) == 1
    assert Registration.objects.count() == 1


@pytest.mark.defaults
def test_a_new_channel_uri_moves_every_account_and_revives_dead_ones(client, app):
    register(client, app, "a@example.org", "b@example.org")
    Registration.objects.update(dead_since=timezone.now())
    new_channel = CHANNEL.replace("db5p", "am3p")
    assert post(client, app, channel_message(channel=new_channel)).status_code == 200
    assert set(Registration.objects.values_list("token", flat=True)) == {new_channel}
    assert not Registration.objects.filter(dead_since__isnull=False).exists()
    assert WnsDevice.objects.get().channel_uri == new_channel


@pytest.mark.defaults
def test_accounts_need_a_known_device(client, app):
    assert_error(post(client, app, accounts_message("a@example.org")), 404, "Device id unknown.")
    message = {"version": 1, "action": "request_test_push", "device_id": DEVICE_ID}
    assert_error(post(client, app, message), 404, "Device id unknown.")


@pytest.mark.defaults
def test_devices_are_per_app(client, app, component):
    register(client, app, "a@example.org")
    other_app = App.objects.create(tenant=app.tenant, name="other")
    Component.objects.create(
        tenant=app.tenant, app=other_app, jid="push2.localhost", secret="x", port=5347
    )
    assert_error(post(client, other_app, accounts_message("a@example.org")), 404, "unknown")
    body = register(client, other_app, "a@example.org")
    assert body["push_bare_jid"] == "push2.localhost"
    assert WnsDevice.objects.count() == 2


@pytest.mark.defaults
def test_push_bare_jid_is_the_apps_first_enabled_component(client, app, component):
    Component.objects.filter(pk=component.pk).update(enabled=False)
    later = Component.objects.create(
        tenant=app.tenant, app=app, jid="push-b.localhost", secret="x", port=5347
    )
    Component.objects.create(
        tenant=app.tenant, app=app, jid="push-c.localhost", secret="x", port=5347
    )
    assert register(client, app, "a@example.org")["push_bare_jid"] == later.jid


@pytest.mark.defaults
def test_no_component_refuses_accounts_but_still_turns_push_off(client, app, component):
    Component.objects.filter(pk=component.pk).update(enabled=False)
    assert post(client, app, channel_message()).status_code == 200
    assert_error(post(client, app, accounts_message("a@example.org")), 503, "component")
    response = post(client, app, accounts_message())
    assert response.status_code == 200
    assert response.json()["push_bare_jid"] == ""


@pytest.mark.defaults
def test_a_suspended_tenant_is_temporarily_unavailable(client, app):
    Tenant.objects.filter(pk=app.tenant_id).update(suspended=True)
    assert_error(post(client, app, channel_message()), 503, "suspended")


# --- accounts named by account id (the shipped UWPX client) -------------------------------------


@pytest.mark.defaults
def test_accounts_by_id_get_node_and_secret_and_bind_their_domain_at_first_publish(
    client, app, component, send_queue
):
    assert post(client, app, channel_message()).status_code == 200
    message = {
        "version": 1,
        "action": "set_push_accounts",
        "device_id": DEVICE_ID,
        "accounts": [{"account_id": VECTOR}, {"bare_jid": "b@example.org"}],
    }
    body = post(client, app, message).json()
    by_id, by_jid = body["accounts"]
    assert "bare_jid" not in by_id and by_id["account_id"] == VECTOR and by_id["success"]
    assert by_jid["bare_jid"] == "b@example.org"
    registration = Registration.objects.get(device_hash=VECTOR)
    assert registration.account_domain == ""

    def publish(domain: str) -> Verdict:
        return accept_publish(
            Publish(
                component_id=component.pk,
                publishing_domain=domain,
                node=by_id["node"],
                secret=by_id["secret"],
                important=True,
            )
        )

    assert publish("xmpp.uwpx.org") is Verdict.ACCEPTED
    registration.refresh_from_db()
    assert registration.account_domain == "xmpp.uwpx.org"
    assert publish("evil.example") is Verdict.UNKNOWN_NODE


@pytest.mark.defaults
def test_another_devices_account_id_is_refused_without_revealing_it(client, app):
    victim = register(client, app, "victim@example.org")
    stolen = victim["accounts"][0]["account_id"]
    assert post(client, app, channel_message(OTHER_DEVICE)).status_code == 200
    message = {
        "version": 1,
        "action": "set_push_accounts",
        "device_id": OTHER_DEVICE,
        "accounts": [{"account_id": stolen}],
    }
    response = post(client, app, message)
    assert_error(response, 409, "accounts[0]")
    text = response.content.decode()
    assert victim["accounts"][0]["node"] not in text
    assert victim["accounts"][0]["secret"] not in text
    owner = Registration.objects.get().wns_account.device
    assert owner.device_id_hash == uwpx.device_id_hash(DEVICE_ID)


@pytest.mark.defaults
def test_one_device_never_sees_another_devices_accounts(client, app):
    mine = register(client, app, "a@example.org")
    theirs = register(client, app, "a@example.org", device_id=OTHER_DEVICE)
    assert mine["accounts"][0]["node"] != theirs["accounts"][0]["node"]
    assert mine["accounts"][0]["account_id"] != theirs["accounts"][0]["account_id"]
    post(client, app, accounts_message(device_id=OTHER_DEVICE))
    assert Registration.objects.count() == 1  # only the other device's account went


# --- validation: every error, in the UWPX error shape --------------------------------------------

VALID = channel_message()


def without(message: dict, key: str) -> dict:
    return {k: v for k, v in message.items() if k != key}


CASES = [
    ("not json", b"{not json", 400, "Invalid JSON format."),
    ("not utf-8", b'{"version": 1, "action": "\xff"}', 400, "Invalid JSON format."),
    ("empty body", b"", 422, "request body: must be a JSON object"),
    ("a list", b"[]", 422, "must be a JSON object"),
    ("a string", b'"hello"', 422, "must be a JSON object"),
    ("no version", without(VALID, "version"), 422, "version: is required"),
    ("version as text", VALID | {"version": "1"}, 422, "version: must be the integer 1"),
    ("version true", VALID | {"version": True}, 422, "version: must be the integer 1"),
    ("version 1.0", VALID | {"version": 1.0}, 422, "version: must be the integer 1"),
    ("version 2", VALID | {"version": 2}, 422, "version: must be the integer 1"),
    ("no action", without(VALID, "action"), 422, "action is required"),
    ("unknown action", VALID | {"action": "hack"}, 422, "action: unknown action"),
    ("action not text", VALID | {"action": 7}, 422, "action: unknown action"),
    ("no device id", without(VALID, "device_id"), 422, "device_id: is required"),
    ("device id short", VALID | {"device_id": "ab" * 15}, 422, uwpx.DEVICE_ID_RULE[:-1]),
    ("device id long", VALID | {"device_id": "a" * 129}, 422, uwpx.DEVICE_ID_RULE[:-1]),
    ("device id not hex", VALID | {"device_id": "g" * 64}, 422, uwpx.DEVICE_ID_RULE[:-1]),
    ("device id newline", VALID | {"device_id": "a" * 64 + "\n"}, 422, uwpx.DEVICE_ID_RULE[:-1]),
    ("device id number", VALID | {"device_id": 12345}, 422, uwpx.DEVICE_ID_RULE[:-1]),
    ("unknown field", VALID | {"extra": 1}, 422, "extra: is not a known field"),
    ("no channel uri", without(VALID, "channel_uri"), 422, "channel_uri: is required"),
    ("channel uri number", VALID | {"channel_uri": 5}, 422, "channel_uri: must be a string"),
    ("channel http", VALID | {"channel_uri": CHANNEL.replace("https", "http")}, 422, "https"),
    ("channel host", VALID | {"channel_uri": "https://evil.example/?token=x"}, 422, "channel_uri"),
    (
        "channel lookalike",
        VALID | {"channel_uri": "https://notify.windows.com.evil.example/"},
        422,
        "channel_uri",
    ),
    (
        "channel userinfo",
        VALID | {"channel_uri": "https://x@db5p.notify.windows.com/"},
        422,
        "channel_uri",
    ),
    ("channel too long", VALID | {"channel_uri": CHANNEL + "a" * 2048}, 422, "channel_uri"),
    ("channel empty", VALID | {"channel_uri": ""}, 422, "channel_uri"),
]

ACCOUNT_CASES = [
    ("accounts missing", {"accounts": None}, "accounts: is required"),
    ("accounts not a list", {"accounts": {"bare_jid": "a@b.org"}}, "accounts: must be a list"),
    ("account not an object", {"accounts": ["a@b.org"]}, "accounts[0]: must be a JSON object"),
    ("account empty", {"accounts": [{}]}, "accounts[0]: needs either bare_jid or account_id"),
    (
        "account with both",
        {"accounts": [{"bare_jid": "a@b.org", "account_id": VECTOR}]},
        "needs either bare_jid or account_id",
    ),
    (
        "account unknown field",
        {"accounts": [{"bare_jid": "a@b.org", "jid": "x"}]},
        "accounts[0].jid: is not a known field",
    ),
    ("jid number", {"accounts": [{"bare_jid": 5}]}, "accounts[0].bare_jid: must be a string"),
    ("jid empty", {"accounts": [{"bare_jid": ""}]}, "accounts[0].bare_jid"),
    ("jid resource", {"accounts": [{"bare_jid": "a@b.org/phone"}]}, "without a /resource"),
    ("jid domain only", {"accounts": [{"bare_jid": "b.org"}]}, "account's JID (name@domain)"),
    ("jid two ats", {"accounts": [{"bare_jid": "a@b@c.org"}]}, "not a valid JID"),
    ("jid space", {"accounts": [{"bare_jid": "a b@c.org"}]}, "not a valid JID"),
    ("jid bad domain", {"accounts": [{"bare_jid": "a@-b.org"}]}, "not a valid JID"),
    ("jid nul", {"accounts": [{"bare_jid": "a\u0000@b.org"}]}, "not a valid JID"),
    (
        "jid second entry",
        {"accounts": [{"bare_jid": "a@b.org"}, {"bare_jid": "@b.org"}]},
        "accounts[1].bare_jid",
    ),
    ("jid too long", {"accounts": [{"bare_jid": "a" * 1024 + "@b.org"}]}, "not a valid JID"),
    ("account id short", {"accounts": [{"account_id": "abc"}]}, "64 hexadecimal"),
    ("account id not hex", {"accounts": [{"account_id": "z" * 64}]}, "64 hexadecimal"),
]


@pytest.mark.defaults
@pytest.mark.parametrize(
    ("body", "status", "fragment"), [case[1:] for case in CASES], ids=[c[0] for c in CASES]
)
def test_every_invalid_set_channel_uri_is_refused_clearly(client, app, body, status, fragment):
    assert_error(post(client, app, body), status, fragment)
    assert not WnsDevice.objects.exists()


@pytest.mark.defaults
@pytest.mark.parametrize(
    ("change", "fragment"), [case[1:] for case in ACCOUNT_CASES], ids=[c[0] for c in ACCOUNT_CASES]
)
def test_every_invalid_account_list_is_refused_clearly(client, app, change, fragment):
    register(client, app, "kept@example.org")
    message = accounts_message() | change
    if change.get("accounts", ...) is None:
        del message["accounts"]
    assert_error(post(client, app, message), 422, fragment)
    assert Registration.objects.count() == 1  # nothing changed


@pytest.mark.defaults
def test_too_many_accounts(client, app, settings):
    settings.RELAY = settings.RELAY | {"UWPX_MAX_ACCOUNTS": 3}
    assert post(client, app, channel_message()).status_code == 200
    jids = [f"user{i}@example.org" for i in range(4)]
    assert_error(post(client, app, accounts_message(*jids)), 422, "at most 3 accounts")
    assert post(client, app, accounts_message(*jids[:3])).status_code == 200


@pytest.mark.defaults
def test_body_size_limit(client, app, settings):
    settings.RELAY = settings.RELAY | {"UWPX_MAX_BODY_BYTES": 1024}
    big = channel_message() | {"channel_uri": CHANNEL + "a" * 1024}
    assert_error(post(client, app, big), 413, "at most 1024 bytes")
    huge = b"{" + b" " * (100 * 1024) + b"}"  # above Django's own upload limit too
    assert_error(post(client, app, huge), 413, "Message too large")
    assert post(client, app, channel_message()).status_code == 200


@pytest.mark.defaults
def test_unknown_or_malformed_app_key(client):
    for key in ("nope", "bad%00key", "x" * 100):
        response = client.post(
            f"/api/v1/apps/{key}/uwpx", data=json.dumps(VALID), content_type="application/json"
        )
        assert_error(response, 404, "Unknown app key.")


@pytest.mark.defaults
def test_action_must_match_a_per_action_url(client, app):
    assert_error(post(client, app, VALID, "set_accounts"), 422, "action")
    assert_error(post(client, app, accounts_message(), "set_channel_uri"), 422, "action")


@pytest.mark.defaults
def test_only_post(client, app):
    assert client.get(url(app)).status_code == 405


# --- rate limits ------------------------------------------------------------------------------


@pytest.mark.defaults
def test_rate_limit_per_client_address(client, app, settings):
    # Windows are fixed (aligned to the clock): an hour, so that the test never spans two.
    settings.RELAY = settings.RELAY | {"UWPX_RATE_LIMIT_ADDRESS": (3, 3600)}
    for _ in range(3):
        assert post(client, app, channel_message()).status_code == 200
    response = post(client, app, channel_message())
    assert_error(response, 429, "Too many requests")
    assert 1 <= int(response["Retry-After"]) <= 3600
    # Checked before the body is read: garbage is limited too, and other addresses are not.
    assert post(client, app, b"{garbage").status_code == 429
    assert post(client, app, channel_message(), REMOTE_ADDR="192.0.2.7").status_code == 200


@pytest.mark.defaults
def test_rate_limit_per_device_id_whatever_the_address(client, app, settings):
    settings.RELAY = settings.RELAY | {"UWPX_RATE_LIMIT_DEVICE": (2, 3600)}
    for address in ("192.0.2.1", "192.0.2.2"):
        assert post(client, app, channel_message(), REMOTE_ADDR=address).status_code == 200
    assert_error(post(client, app, channel_message(), REMOTE_ADDR="192.0.2.3"), 429, "Too many")
    assert post(client, app, channel_message(OTHER_DEVICE)).status_code == 200


@pytest.mark.defaults
def test_test_pushes_have_their_own_tighter_limit(client, app, settings, send_queue):
    settings.RELAY = settings.RELAY | {"UWPX_RATE_LIMIT_TEST_PUSH": (1, 600)}
    register(client, app, "a@example.org")
    message = {"version": 1, "action": "request_test_push", "device_id": DEVICE_ID}
    assert post(client, app, message).status_code == 200
    assert_error(post(client, app, message), 429, "Too many requests")
    assert post(client, app, channel_message()).status_code == 200  # other actions still work
    assert len(send_queue.queued_jobs()) == 1


@pytest.mark.defaults
def test_forwarded_address_only_from_trusted_proxies(client, app, settings):
    settings.RELAY = settings.RELAY | {"UWPX_RATE_LIMIT_ADDRESS": (1, 60)}
    headers = {"HTTP_X_FORWARDED_FOR": "198.51.100.1"}
    assert post(client, app, channel_message(), **headers).status_code == 200
    # Not trusted: the header is ignored, so a second one is the same (limited) peer.
    assert (
        post(client, app, channel_message(), HTTP_X_FORWARDED_FOR="198.51.100.2").status_code == 429
    )
    settings.RELAY = settings.RELAY | {"API_TRUSTED_PROXIES": 1}
    assert (
        post(
            client, app, channel_message(), HTTP_X_FORWARDED_FOR="spoofed, 198.51.100.3"
        ).status_code
        == 200
    )
    assert (
        post(client, app, channel_message(), HTTP_X_FORWARDED_FOR="198.51.100.3").status_code == 429
    )


def _cache_setting(kind: str, tmp_path) -> tuple[dict, dict[str, str]]:
    """A cache both this process and a child process use, and the child's environment."""
    from django.conf import settings as django_settings

    if kind == "file":
        location = tmp_path / "cache"
        setting = {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(location),
        }
        return setting, {"VAR_DIR": str(tmp_path), "CACHE_URL": ""}
    broker = django_settings.RELAY["STATE_URL"]
    prefix = f"test-{uuid.uuid4().hex}"
    # The state's Redis, with keys of our own (nothing is ever cleared).
    setting = {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": broker,
        "KEY_PREFIX": prefix,
    }
    return setting, {"CACHE_URL": broker, "CACHE_PREFIX_FOR_TEST": prefix}


@pytest.mark.parametrize(
    "kind",
    [pytest.param("file", marks=pytest.mark.defaults), pytest.param("redis")],
)
def test_device_limit_is_shared_across_processes(kind, settings, tmp_path):
    """Another process (a second web worker, the TLS listener) spends the same budget."""
    if kind == "redis" and not settings.RELAY["STATE_URL"].startswith("redis"):
        pytest.fail("the Redis variant needs RELAY_STATE_URL=redis://… (make test sets it)")
    setting, env = _cache_setting(kind, tmp_path)
    settings.CACHES = {"default": setting}
    settings.RELAY = settings.RELAY | {"UWPX_RATE_LIMIT_DEVICE": (3, 3600)}
    script = (
        "import os, django\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'pushsite.settings')\n"
        "django.setup()\n"
        "from django.conf import settings\n"
        "prefix = os.environ.get('CACHE_PREFIX_FOR_TEST')\n"
        "if prefix: settings.CACHES['default']['KEY_PREFIX'] = prefix\n"
        "settings.RELAY['UWPX_RATE_LIMIT_DEVICE'] = (3, 3600)\n"
        "from relay.windows import services as uwpx\n"
        f"for _ in range(3): uwpx.check_device_rate(device_id={DEVICE_ID!r}, action='x')\n"
    )
    child_env = dict(os.environ, SECRET_KEY=settings.SECRET_KEY, **env)
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=child_env, check=True)
    with pytest.raises(uwpx.UwpxError) as raised:
        uwpx.check_device_rate(device_id=DEVICE_ID, action="x")
    assert raised.value.kind is uwpx.ErrorKind.RATE_LIMITED
    uwpx.check_device_rate(device_id=OTHER_DEVICE, action="x")


def test_the_redis_counters_are_the_ones_djangos_cache_reads(settings, tmp_path):
    """The script counts through a redis-py client of ours (Django keeps its own private):
    in the keys, and as the values, that Django's cache API reads and writes."""
    from django.core.cache import caches

    from relay.windows.services import limits

    if not settings.RELAY["STATE_URL"].startswith("redis"):
        pytest.fail("needs RELAY_STATE_URL=redis://… (make test sets it)")
    setting, _ = _cache_setting("redis", tmp_path)
    settings.CACHES = {"default": setting}
    key = f"counter-{uuid.uuid4().hex}"
    assert limits._count([(key, 60)]) == [1]
    assert limits._count([(key, 60), (key + "-b", 60)]) == [2, 1]
    assert caches["default"].get(key) == 2
    caches["default"].incr(key)
    assert limits._count([(key, 60)]) == [4]


@pytest.mark.defaults
def test_an_unreachable_cache_does_not_stop_registration(client, app, settings):
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",
            "OPTIONS": {"socket_connect_timeout": 0.2},
        }
    }
    assert post(client, app, channel_message()).status_code == 200


# --- test pushes --------------------------------------------------------------------------------


@pytest.mark.defaults
def test_request_test_push_queues_one_send_for_the_first_account(client, app, send_queue):
    register(client, app, "a@example.org", "b@example.org")
    first = Registration.objects.order_by("id").first()
    message = {"version": 1, "action": "request_test_push", "device_id": DEVICE_ID}
    response = post(client, app, message)
    assert response.status_code == 200
    assert response.json() == json.loads(SEED_SUCCESS)
    [job] = send_queue.queued_jobs()
    assert job["registration_id"] == first.pk
    assert job["important"] is True
    assert CHANNEL not in repr(job) and DEVICE_ID not in repr(job)


@pytest.mark.defaults
def test_request_test_push_needs_live_accounts(client, app, send_queue):
    assert post(client, app, channel_message()).status_code == 200
    message = {"version": 1, "action": "request_test_push", "device_id": DEVICE_ID}
    assert_error(post(client, app, message), 409, "send set_accounts first")
    post(client, app, accounts_message("a@example.org"))
    Registration.objects.update(dead_since=timezone.now())
    assert_error(post(client, app, message), 409, "send set_channel_uri again")
    assert send_queue.queued_jobs() == []


@pytest.mark.defaults
def test_request_test_push_when_the_queue_is_down(client, app, monkeypatch):
    from relay.services import queue

    register(client, app, "a@example.org")

    def down(*args, **kwargs):
        raise queue.QueueUnavailable

    monkeypatch.setattr(queue, "enqueue_send", down)
    monkeypatch.setattr("relay.services.test_push.enqueue_send", down)
    message = {"version": 1, "action": "request_test_push", "device_id": DEVICE_ID}
    assert_error(post(client, app, message), 503, "try again later")


@pytest.mark.defaults
def test_a_database_outage_is_a_503_in_the_uwpx_shape(client, app, monkeypatch):
    from django.db import OperationalError

    def down(**kwargs):
        raise OperationalError("connection refused")

    monkeypatch.setattr(uwpx, "set_channel_uri", down)
    assert_error(post(client, app, channel_message()), 503, "Temporarily unavailable")


@pytest.mark.defaults
def test_an_internal_error_is_a_500_in_the_uwpx_shape(client, app, monkeypatch):
    def broken(**kwargs):
        raise RuntimeError("bug")

    monkeypatch.setattr(uwpx, "set_channel_uri", broken)
    error = assert_error(post(client, app, channel_message()), 500, "Internal server error")
    assert "bug" not in error


# --- stale devices ------------------------------------------------------------------------------


@pytest.mark.defaults
def test_stale_devices_are_removed_with_their_accounts(client, app, settings):
    settings.RELAY = settings.RELAY | {"UWPX_STALE_DAYS": 30}
    register(client, app, "a@example.org")
    register(client, app, "b@example.org", device_id=OTHER_DEVICE)
    old = timezone.now() - timedelta(days=31)
    WnsDevice.objects.filter(device_id_hash=uwpx.device_id_hash(DEVICE_ID)).update(updated=old)

    from relay.windows.tasks import remove_stale_uwpx_devices

    assert remove_stale_uwpx_devices() == 1
    assert WnsDevice.objects.get().device_id_hash == uwpx.device_id_hash(OTHER_DEVICE)
    assert Registration.objects.count() == 1
    assert_error(post(client, app, accounts_message("a@example.org")), 404, "Device id unknown.")


@pytest.mark.defaults
def test_any_update_keeps_a_device_fresh_and_zero_days_keeps_all(client, app, settings):
    register(client, app, "a@example.org")
    old = timezone.now() - timedelta(days=400)
    WnsDevice.objects.update(updated=old)
    post(client, app, accounts_message("a@example.org"))
    assert uwpx.remove_stale_devices(older_than_days=30) == 0
    WnsDevice.objects.update(updated=old)
    assert uwpx.remove_stale_devices(older_than_days=0) == 0
    assert uwpx.remove_stale_devices(older_than_days=30) == 1


@pytest.mark.defaults
def test_the_beat_schedule_runs_the_registered_stale_task(settings):
    """The Windows app adds its entry to beat's schedule (relay.features), which beat reads
    once its loader imported the task modules, as here."""
    from pushsite.celery import app as celery_app

    assert "remove-stale-uwpx-devices" not in settings.CELERY_BEAT_SCHEDULE  # not the core's
    celery_app.loader.import_default_modules()
    entry = celery_app.conf.beat_schedule["remove-stale-uwpx-devices"]
    assert entry["task"] in celery_app.tasks
    assert entry["schedule"] == settings.RELAY["UWPX_STALE_CHECK_SECONDS"] > 0


# --- schema and docs ----------------------------------------------------------------------------


@pytest.mark.defaults
def test_openapi_schema_is_served(client):
    schema = client.get("/api/v1/openapi.json").json()
    paths = schema["paths"]
    for suffix in ("", "/set_channel_uri", "/set_accounts", "/request_test_push"):
        operation = paths["/api/v1/apps/{app_key}/uwpx" + suffix]["post"]
        assert {"200", "404", "422", "429"} <= set(operation["responses"])
    schemas = schema["components"]["schemas"]
    assert schemas["SetAccounts"]["additionalProperties"] is False
    assert schemas["SetChannelUri"]["properties"]["device_id"]["pattern"] == uwpx.DEVICE_ID_PATTERN


@pytest.mark.defaults
def test_interactive_docs_are_served_without_a_cdn(client, settings):
    settings.STORAGES = settings.STORAGES | {
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}
    }
    response = client.get("/api/v1/docs")
    assert response.status_code == 200
    page = response.content.decode()
    assert "swagger-ui-bundle.js" in page and "/api/v1/openapi.json" in page
    assert "cdn.jsdelivr" not in page and "unpkg.com" not in page


# --- channels the app can never send to -----------------------------------------------------


@pytest.mark.defaults
def test_a_bare_host_pattern_allows_the_default_port_only_and_the_refusal_says_so(client, app):
    """`127.0.0.1` as a channel host matches port 80/443 only: a channel on another port is
    refused when it is registered (422, saying how to write the pattern), not dead-lettered
    at every push."""
    change_credentials(app, "wns", channel_hosts="127.0.0.1")
    channel = "http://127.0.0.1:8080/wns/channel?token=abc"
    error = assert_error(
        post(client, app, channel_message(channel=channel)),
        422,
        "channel_uri:",
        "'127.0.0.1' allows port 80 only, not 8080",
        "127.0.0.1:8080",
    )
    assert channel not in error  # the refusal never echoes the capability
    assert not WnsDevice.objects.exists()
    change_credentials(app, "wns", channel_hosts="127.0.0.1:8080")
    assert post(client, app, channel_message(channel=channel)).status_code == 200
    change_credentials(app, "wns", channel_hosts="127.0.0.1:*")
    assert post(client, app, channel_message(channel=channel)).status_code == 200


@pytest.mark.defaults
def test_accounts_are_refused_for_a_channel_the_app_may_no_longer_send_to(client, app):
    assert post(client, app, channel_message()).status_code == 200
    change_credentials(app, "wns", channel_hosts="*.wns.example.net")
    assert_error(
        post(client, app, accounts_message("alice@example.org")),
        409,
        "no longer allowed",
        "*.wns.example.net",
        "set_channel_uri again",
    )
    assert not Registration.objects.exists()
    # An empty list (push off) is still fine: nothing will be sent.
    assert post(client, app, accounts_message()).status_code == 200
