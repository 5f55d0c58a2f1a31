"""Provider fakes speaking each provider's wire protocol; each also runs as a process for the
benchmarks (`python -m tests.fakes.<provider>`)."""

from __future__ import annotations

import json
import signal
import threading
from typing import Any


def announce_and_serve(info: dict[str, Any]) -> None:
    """Prints `info` as one JSON line (what a benchmark reads to reach the fake), then waits
    for SIGINT or SIGTERM; the caller stops its fake after. The handlers come first: a reader
    may signal as soon as it has the line."""
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    print(json.dumps(info), flush=True)
    stopped.wait()
