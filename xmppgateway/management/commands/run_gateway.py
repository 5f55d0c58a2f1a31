"""`manage.py run_gateway`: hold the links of all enabled components until SIGTERM."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from django.core.management.base import BaseCommand

from xmppgateway.gateway import Gateway


class Command(BaseCommand):
    help = "Run the XMPP gateway: one XEP-0114 link per enabled component."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--poll-seconds",
            type=float,
            default=None,
            help="How often to look for changed components.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        gateway = Gateway(poll_seconds=options["poll_seconds"])
        # Everything loaded so far (Django, slixmpp, the models) lives as long as the process:
        # left out of the collector's full passes, which otherwise stall the event loop for
        # tens of milliseconds now and then (the relay's p99).
        gc.freeze()
        asyncio.run(gateway.run())
