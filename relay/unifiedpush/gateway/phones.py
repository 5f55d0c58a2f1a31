"""Which phones did not take their last push, and until when they are held back."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

# (component id, the phone's recipient key): one phone on one component.
PhoneKey = tuple[int, str]


@dataclass(slots=True)
class Recipient:
    """A phone that did not take its last push: held back until `retry_at` or its return."""

    failures: int = 0
    retry_at: float = 0.0
    probing: bool = False  # its oldest message went out again: the others wait for the answer


@dataclass
class Phones:
    """The backoff state of phones that are away; a phone not in it is not held back.
    Only a cache: after a restart, stored messages go out and show who is away again."""

    away: dict[PhoneKey, Recipient] = field(default_factory=dict)

    def held(self, key: PhoneKey) -> bool:
        state = self.away.get(key)
        return state is not None and (state.probing or time.monotonic() < state.retry_at)

    def in_backoff(self, key: PhoneKey) -> bool:
        """Held back until a retry time still ahead (a probe in flight does not count)."""
        state = self.away.get(key)
        return state is not None and time.monotonic() < state.retry_at

    def failed(self, key: PhoneKey) -> Recipient:
        state = self.away.setdefault(key, Recipient())
        state.failures += 1
        state.probing = False
        return state

    def went_away(self, key: PhoneKey, *, hold: float) -> None:
        """Unavailable presence: held back for `hold` seconds unless it comes back first."""
        state = self.away.setdefault(key, Recipient())
        state.failures = max(state.failures, 1)
        state.retry_at = time.monotonic() + hold
        state.probing = False

    def back(self, keys: Iterable[PhoneKey]) -> bool:
        """The phone is there again; True when it had been held back."""
        return any([self.away.pop(key, None) is not None for key in keys])

    def forget_older_than(self, horizon: float) -> None:
        """Phones that never came back: their backoff state is no use once long past."""
        for key in [k for k, state in self.away.items() if state.retry_at < horizon]:
            del self.away[key]
