"""The identifiers of the p2 protocol: account hashes, nodes and secrets.

The phone recomputes the hashes to find which account to wake, so they must match p2 exactly.
"""

from __future__ import annotations

import base64
import hashlib
import secrets


def account_hash(bare_jid: str, device_id: str) -> str:
    """sha1_hex(bare_jid + NUL + device_id); also used with a room JID for a room."""
    return hashlib.sha1(f"{bare_jid}\0{device_id}".encode()).hexdigest()


def new_node() -> str:
    """12 characters from 9 random bytes, as p2 makes them."""
    return base64.urlsafe_b64encode(secrets.token_bytes(9)).decode()


def new_secret() -> str:
    """24 characters from 18 random bytes, as p2 makes them."""
    return base64.b64encode(secrets.token_bytes(18)).decode()
