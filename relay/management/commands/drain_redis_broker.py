"""`manage.py drain_redis_broker`: empty the Redis broker of earlier releases before switching
to RabbitMQ (docs/broker.md, "Upgrading from the Redis broker"); the logic is in
relay/services/redis_drain.py."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from relay.services import redis_drain
from relay.services.queue import QueueUnavailable


class Command(BaseCommand):
    help = (
        "With the gateways stopped: wait until the old workers have emptied the Redis broker "
        "(default), or, with the old workers stopped too, --move what is left to the current "
        "broker (CELERY_BROKER_URL), confirmed, with the same push ids."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--from", dest="source", required=True, help="the old redis:// URL")
        parser.add_argument("--move", action="store_true", help="publish what is left here")
        parser.add_argument(
            "--timeout", type=float, default=0.0, help="give up after this many seconds (0: never)"
        )
        parser.add_argument(
            "--interval", type=float, default=5.0, help="seconds between two counts"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            client = redis_drain.connect(options["source"])
            if options["move"]:
                try:
                    moved = redis_drain.move(client)
                except QueueUnavailable as error:
                    raise CommandError(
                        f"the new broker did not take a message ({error.__cause__!r}); "
                        "what is left stays in Redis: run the command again"
                    ) from error
                self.stdout.write(f"moved {moved} message(s); the Redis broker is empty")
                return
            self._wait(client, options["timeout"], options["interval"])
        except (ValueError, OSError) as error:
            raise CommandError(str(error)) from error
        except redis_drain.redis.RedisError as error:
            raise CommandError(f"Redis: {error}") from error

    def _wait(self, client: Any, timeout: float, interval: float) -> None:
        deadline = time.monotonic() + timeout if timeout else None
        while (left := redis_drain.left(client)).total:
            self.stdout.write(
                f"left: {left.waiting} waiting, {left.unacknowledged} held by workers, "
                f"{left.in_transit} on their way to one"
            )
            if deadline is not None and time.monotonic() >= deadline:
                raise CommandError(f"{left.total} message(s) still in the Redis broker")
            time.sleep(interval)
        self.stdout.write("the Redis broker is empty: switch CELERY_BROKER_URL to RabbitMQ")
