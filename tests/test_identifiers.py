"""The p2 identifiers: the phone recomputes these hashes, so they must match exactly."""

import base64
import re

import pytest

from relay.identifiers import account_hash, new_node, new_secret

pytestmark = pytest.mark.defaults


def test_account_hash_matches_the_seed_vector():
    assert account_hash("xiaomia1@jabber.de", "92afd7a91cdba9a0") == (
        "ec164939a8485ee6b7f7871071a11c7bb18aead5"
    )


def test_room_hash_uses_the_room_jid_with_the_same_rule():
    room = account_hash("room@conference.jabber.de", "92afd7a91cdba9a0")
    assert re.fullmatch(r"[0-9a-f]{40}", room)
    assert room != account_hash("xiaomia1@jabber.de", "92afd7a91cdba9a0")


def test_node_is_twelve_characters_of_nine_random_bytes():
    nodes = {new_node() for _ in range(200)}
    assert len(nodes) == 200
    for node in nodes:
        assert len(node) == 12
        assert len(base64.urlsafe_b64decode(node)) == 9


def test_secret_is_twenty_four_characters_of_eighteen_random_bytes():
    secrets = {new_secret() for _ in range(200)}
    assert len(secrets) == 200
    for secret in secrets:
        assert len(secret) == 24
        assert len(base64.b64decode(secret)) == 18


def test_app_public_keys_never_look_like_a_command_line_option() -> None:
    from relay.models import new_public_key

    keys = [new_public_key() for _ in range(2000)]
    assert all(len(key) >= 20 and not key.startswith("-") for key in keys)
    assert len(set(keys)) == len(keys)
