"""Endpoint tokens and the key ring: what a URL holds, and what it refuses to be."""

from __future__ import annotations

import base64
import os
import time

import pytest
from django.conf import settings
from django.test import override_settings

from relay.unifiedpush.services import keys, tokens
from relay.unifiedpush.services.keys import KeyRing, keyring, new_master_key

pytestmark = pytest.mark.defaults

JID = "juliet@example.com/Conversations.r4nD"
APPLICATION = os.urandom(32)
INSTANCE = os.urandom(32)


def keys_setting(*keys: str) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, "UNIFIEDPUSH_KEYS": keys})


def issue(ring=None, *, jid=JID, expires=None):
    return tokens.issue(
        jid=jid,
        application=APPLICATION,
        instance=INSTANCE,
        component_id=7,
        expires=expires or int(time.time()) + 86400,
        ring=ring,
    )


def test_a_token_round_trips_everything_it_routes_by():
    token, issued = issue()
    opened = tokens.open_token(token, now=time.time())
    assert opened == issued
    assert (opened.jid, opened.application, opened.instance) == (JID, APPLICATION, INSTANCE)
    assert opened.component_id == 7 and len(opened.endpoint_id) == 8
    assert token.startswith("v4.local.")


def test_nothing_about_the_account_is_readable_from_the_token():
    token, _ = issue()
    readable = token + "".join(
        base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)).decode("latin-1")
        for part in token.split(".")[2:]
    )
    for secret in ("juliet", "example.com", "Conversations"):
        assert secret not in readable
    assert base64.b64encode(APPLICATION).decode()[:12] not in token


def test_two_registrations_of_the_same_pair_are_different_endpoints():
    first, a = issue()
    second, b = issue()
    assert first != second and a.endpoint_id != b.endpoint_id


def flip(token: str, index: int) -> str:
    char = token[index]
    return token[:index] + ("A" if char != "A" else "B") + token[index + 1 :]


@pytest.mark.parametrize("where", ["payload-start", "payload-middle", "tag", "footer"])
def test_a_tampered_token_is_refused(where):
    token, _ = issue()
    body_start = len("v4.local.")
    footer_start = token.rindex(".") + 1
    index = {
        "payload-start": body_start + 3,
        "payload-middle": (body_start + footer_start) // 2,
        "tag": footer_start - 3,
        "footer": footer_start + 2,
    }[where]
    with pytest.raises(tokens.InvalidToken):
        tokens.open_token(flip(token, index), now=time.time())


@pytest.mark.parametrize("cut", [1, 10, 60])
def test_a_truncated_token_is_refused(cut):
    token, _ = issue()
    payload, footer = token.rsplit(".", 1)
    with pytest.raises(tokens.InvalidToken):
        tokens.open_token(payload[:-cut] + "." + footer, now=time.time())
    with pytest.raises(tokens.InvalidToken):
        tokens.open_token(token[:-cut], now=time.time())


def test_a_token_of_a_foreign_key_is_refused():
    foreign = KeyRing((keys._make_key(os.urandom(32)),))
    token, _ = issue(foreign)
    with pytest.raises(tokens.InvalidToken, match="unknown key"):
        tokens.open_token(token, now=time.time())


def test_a_foreign_key_claiming_our_kid_is_refused():
    ours = keyring().current
    impostor = keys._make_key(os.urandom(32))
    forged = KeyRing(
        (keys.UnifiedPushKey(ours.kid, impostor.token_key, impostor.sealing, impostor.hashing),)
    )
    token, _ = issue(forged)
    with pytest.raises(tokens.InvalidToken, match="authenticate"):
        tokens.open_token(token, now=time.time())


def test_an_expired_token_is_refused():
    token, _ = issue(expires=int(time.time()) + 60)
    tokens.open_token(token, now=time.time())
    with pytest.raises(tokens.InvalidToken, match="expired"):
        tokens.open_token(token, now=time.time() + 61)


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "v4.local.",
        "v4.local..",
        "v2.local.abc.def",
        "v4.public." + "A" * 200 + ".AAAAAAAAAAA",
        "v4.local." + "A" * 200 + ".AAAAAAAAAAA",
        "v4.local." + "A" * 2000 + ".AAAAAAAAAAA",
        "../../etc/passwd",
        "v4.local." + "é" * 150 + ".AAAAAAAAAAA",
    ],
)
def test_garbage_is_refused(garbage):
    with pytest.raises(tokens.InvalidToken):
        tokens.open_token(garbage, now=time.time())


def test_rotation_new_key_encrypts_and_old_tokens_still_open():
    old_key = new_master_key()
    with keys_setting(old_key):
        old_token, _ = issue()
    new_key = new_master_key()
    with keys_setting(new_key, old_key):
        assert tokens.open_token(old_token, now=time.time()).jid == JID
        new_token, issued = issue()
        assert (
            issued.kid == keyring().current.kid != tokens.open_token(old_token, now=time.time()).kid
        )
    with keys_setting(new_key):  # the old key dropped
        assert tokens.open_token(new_token, now=time.time()).jid == JID
        with pytest.raises(tokens.InvalidToken):
            tokens.open_token(old_token, now=time.time())


def test_sealed_values_rotate_the_same_way():
    old_key, new_key = new_master_key(), new_master_key()
    with keys_setting(old_key):
        sealed = keyring().seal(b"body")
    with keys_setting(new_key, old_key):
        assert keyring().unseal(sealed) == b"body"
    with keys_setting(new_key), pytest.raises(keys.Unsealable):
        keyring().unseal(sealed)


@pytest.mark.parametrize("bad", ["", "short", base64.b64encode(os.urandom(31)).decode(), "!" * 44])
def test_a_bad_master_key_is_refused(bad):
    with pytest.raises(keys.BadKey):
        keys.decode_master_key(bad)


def test_master_keys_are_read_in_either_base64_alphabet():
    raw = bytes(range(250, 256)) * 5 + b"\xfb\xff"
    assert keys.decode_master_key(base64.b64encode(raw).decode()) == raw
    assert keys.decode_master_key(base64.urlsafe_b64encode(raw).decode().rstrip("=")) == raw
