"""Reading a stored credential: its plain text, or why it cannot be read, and what the
admin shows instead of it.
"""

from __future__ import annotations

import hashlib

from relay.crypto import CredentialKeyError, UnreadableCredential

UNREADABLE = "cannot be decrypted with the configured CREDENTIAL_KEYS; enter it again"


class CredentialsMissing(Exception):
    """The app has no credentials for this provider at all (not an error in them)."""


# --- reading a stored value -------------------------------------------------------------------


def plain(value: str | None, what: str) -> str:
    """The usable plain text of a stored credential; refuses one no configured key decrypts."""
    if isinstance(value, UnreadableCredential):
        raise CredentialKeyError(f"{what} {UNREADABLE}")
    return value or ""


def credential_fingerprint(value: str | None) -> str:
    """What the admin shows instead of a secret: whether it is set and a short hash of it."""
    if isinstance(value, UnreadableCredential):
        return "set · cannot be decrypted with the configured keys"
    if not value:
        return "not set"
    digest = hashlib.sha256(value.encode()).hexdigest()
    return f"set · sha256 {digest[:12]}…"


def lines(text: str) -> tuple[str, ...]:
    """The non-blank lines of a multi-line field, stripped."""
    return tuple(line.strip() for line in (text or "").splitlines() if line.strip())
