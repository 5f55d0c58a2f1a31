"""How a Windows client's request is refused: the kind (mapped to a status by each entry
point) and the clear text of the UWPX error response."""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """Why a request failed; the entry points map it to an HTTP status (or just the text)."""

    MALFORMED = "malformed"  # not JSON at all
    INVALID = "invalid"  # JSON, but not a valid message
    TOO_LARGE = "too_large"
    UNKNOWN_APP = "unknown_app"
    UNKNOWN_DEVICE = "unknown_device"
    CONFLICT = "conflict"  # valid, but not possible in the device's current state
    RATE_LIMITED = "rate_limited"
    UNAVAILABLE = "unavailable"  # passing trouble on our side: try again later


class UwpxError(Exception):
    """A refusal with the clear text of the UWPX error response."""

    def __init__(self, kind: ErrorKind, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after
