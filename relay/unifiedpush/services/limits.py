"""Token buckets in the web process: 429 for an endpoint or a tenant that POSTs too fast.

They live in process memory, so a POST costs no round trip to a shared store; with several
web processes each holds its own buckets (docs/unifiedpush.md, Design notes).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

MAX_BUCKETS = 100_000  # per limiter; beyond, the idlest half is forgotten (full again)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class TokenBuckets:
    """`take(key)` -> 0.0 when allowed, else the seconds until one token is back."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = max(1.0, burst)
        self._buckets: dict[object, _Bucket] = {}
        self._lock = threading.Lock()

    def take(
        self,
        key: object,
        *,
        rate: float | None = None,
        burst: float | None = None,
        now: float | None = None,
    ) -> float:
        rate = self.rate if rate is None else rate
        if rate <= 0:
            return 0.0
        burst = self.burst if burst is None else max(1.0, burst)
        now = time.monotonic() if now is None else now
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                if len(self._buckets) >= MAX_BUCKETS:
                    self._forget_idlest()
                bucket = self._buckets[key] = _Bucket(burst, now)
            else:
                bucket.tokens = min(burst, bucket.tokens + (now - bucket.updated) * rate)
                bucket.updated = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return 0.0
            return (1.0 - bucket.tokens) / rate

    def _forget_idlest(self) -> None:
        by_age = sorted(self._buckets.items(), key=lambda item: item[1].updated)
        for key, _ in by_age[: len(by_age) // 2]:
            del self._buckets[key]

    def clear(self) -> None:
        with self._lock:
            self._buckets.clear()
