"""The tests' own authenticator app: RFC 6238 codes from a copy of the secret, on the real
clock (never a fixed one), as a phone would compute them."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
import time


def totp(secret_base32: str, *, steps_ahead: int = 0, digits: int = 6, step: int = 30) -> str:
    """The code for now (`steps_ahead` later steps: the server accepts one step of drift,
    and refuses a step already used, so a second login in the same 30 s uses the next)."""
    key = base64.b32decode(secret_base32.upper() + "=" * (-len(secret_base32) % 8))
    counter = int(time.time() // step) + steps_ahead
    mac = hmac.new(key, struct.pack(">Q", counter), hashlib.sha1).digest()
    offset = mac[-1] & 0x0F
    number = (struct.unpack(">I", mac[offset : offset + 4])[0] & 0x7FFFFFFF) % 10**digits
    return f"{number:0{digits}d}"
