#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

import os
import signal
import sys
from types import FrameType

# The long-running services, which stop on SIGTERM (or Ctrl-C) by design.
SERVICES = frozenset({"run_gateway", "run_uwpx_listener"})


def _stop_before_started(signum: int, frame: FrameType | None) -> None:
    """A stop asked while the service still loads (seconds on a busy machine): nothing is
    open yet, so it ends at once and cleanly, not killed by the signal nor with a traceback.
    The service's own handling replaces this once it runs."""
    raise SystemExit(0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in SERVICES:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _stop_before_started)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
