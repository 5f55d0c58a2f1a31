"""The gateway's rules for UnifiedPush messages, as plain functions (no XMPP, no asyncio).

The phone's answer to a `<push>` iq decides a message's fate (the `up` protocol):

- `result`: delivered; delete it, record `delivered`.
- error `item-not-found` or `feature-not-implemented`: the endpoint is revoked until its token
  expires; its stored messages end as `revoked`.
- any other error, or no answer in time: temporary; keep it and retry with backoff until its
  TTL passes.
"""

from __future__ import annotations

import enum
import random
from datetime import datetime, timedelta

from relay.unifiedpush.services.store import StoredMessage

REVOKING_CONDITIONS = frozenset({"item-not-found", "feature-not-implemented"})
# A fresh message is sent once even if its TTL (0, say) has passed on the way to the gateway:
# RFC 8030 TTL 0 means "deliver now if the phone is there", not "never".
FIRST_ATTEMPT_GRACE = timedelta(seconds=5)


class Fate(enum.Enum):
    DELIVERED = "delivered"
    REVOKED = "revoked"
    TEMPORARY = "temporary"


def fate(iq_type: str, condition: str | None) -> Fate:
    if iq_type == "result":
        return Fate.DELIVERED
    if iq_type == "error" and condition in REVOKING_CONDITIONS:
        return Fate.REVOKED
    return Fate.TEMPORARY


def retry_delay(
    failures: int, *, base: float, maximum: float, rng: random.Random | None = None
) -> float:
    """Exponential backoff with jitter (between half and the whole of the step)."""
    step = min(maximum, base * (2 ** max(0, failures - 1)))
    return (rng or random).uniform(step / 2, step)


def sendable(message: StoredMessage, now: datetime, *, backlog: bool = False) -> bool:
    """Whether a message may still go out: before its TTL, or fresh and never tried. A
    backlog (what was stored for a phone that was away, brought out when it is back) is
    never fresh: a TTL that passed meanwhile ended the message (RFC 8030 5.2)."""
    if now < message.expires:
        return True
    return not backlog and message.attempts == 0 and now - message.received < FIRST_ATTEMPT_GRACE
