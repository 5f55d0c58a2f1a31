"""The one small interface every push provider implements.

A provider sends one content-free wake-up and classifies the answer as delivered, dead token,
retry later or failed. Everything else (retries, records, dead registrations) is decided by
`relay.services.delivery` from that classification, so a new provider is one new module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from relay.models import Outcome


@dataclass(frozen=True, slots=True)
class Wakeup:
    """What a provider may know of a push: an address and hashes, never a JID or body."""

    push_id: str
    token: str
    account: str
    channel: str = ""
    important: bool = False
    message_count: int | None = None
    pending_subscription_count: int | None = None


@dataclass(frozen=True, slots=True)
class SendResult:
    outcome: Outcome
    error_code: str = ""
    retry_after: float | None = None

    @classmethod
    def delivered(cls) -> SendResult:
        return cls(Outcome.DELIVERED)


class PushProvider(Protocol):
    """Built once per app and credentials version, then reused for many sends."""

    service: ClassVar[str]

    def send(self, wakeup: Wakeup) -> SendResult:
        """Send one wake-up; never raise for a provider's answer, classify it instead."""
        ...

    def close(self) -> None:
        """Release connections when the app's credentials change or the worker stops."""
        ...
