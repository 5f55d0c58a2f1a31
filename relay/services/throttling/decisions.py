"""What the stores decide and take: the types the API and both stores share (no Django)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

KEY_PREFIX = "relay:state:"
# A pending send whose due time is this far gone is presumed lost: stop folding into it.
GRACE_SECONDS = 60.0


class Decision(enum.Enum):
    SEND = "send"  # send now
    SCHEDULE = "schedule"  # queue one delayed send (this publish's push id) at the window's end
    FOLDED = "folded"  # folded into the pending delayed send
    LIMITED = "limited"  # the tenant is over its rate


@dataclass(frozen=True, slots=True)
class Fold:
    """What one publish brings to a (possibly coalesced) send."""

    important: bool
    message_count: int | None = None
    pending_subscription_count: int | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    decision: Decision
    delay: float = 0.0  # SCHEDULE: seconds until the window ends; LIMITED: until a token
    push_id: str = ""  # FOLDED: the pending send that carries this publish


@dataclass(frozen=True, slots=True)
class Taken:
    """The merged publishes a coalesced send carries."""

    important: bool
    message_count: int | None
    pending_subscription_count: int | None
    folded: int


@dataclass(frozen=True, slots=True)
class Limit:
    rate: float
    burst: int

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0


class StateUnavailable(Exception):
    """The store did not answer; callers fail open."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket for `take_tokens`, by its key (without KEY_PREFIX) and limit."""

    key: str
    limit: Limit


@dataclass(frozen=True, slots=True)
class Refusal:
    """`take_tokens` took nothing: `bucket` (its index) is empty for `retry_after` seconds."""

    bucket: int
    retry_after: float


@dataclass(frozen=True, slots=True)
class Ask:
    bucket: str
    limit: Limit
    window_key: str
    window: float
    push_id: str
    fold: Fold


class Store(Protocol):
    def admit(
        self, bucket: str, limit: Limit, window_key: str, window: float, push_id: str, fold: Fold
    ) -> Admission: ...

    def admit_many(self, asks: list[Ask]) -> list[Admission]: ...

    def take(self, window_key: str, push_id: str, window: float) -> Taken | None: ...

    def abandon(self, window_key: str, push_id: str) -> None: ...

    def take_tokens(self, buckets: list[Bucket]) -> Refusal | None: ...

    def ping(self) -> None: ...

    def reset(self) -> None: ...
