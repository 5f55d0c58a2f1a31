"""`manage.py replay_dead_letters`: queue dead letters again, as the admin's replay action does.

Both go through `relay.services.dead_letters.replay` (same push id, a first attempt whose age
counts from the replay, each letter queued once even if two operators replay it at once). The
command exists for the cases the admin is awkward for: thousands of letters after a provider
outage, or a replay from a script.
"""

from __future__ import annotations

import argparse
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count, QuerySet
from django.utils import timezone

from relay.models import DeadLetter, Service
from relay.services import dead_letters
from relay.services.queue import QueueUnavailable

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([mhd])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days"}


def since_argument(text: str) -> datetime:
    """`2026-11-20`, `2026-11-20T08:00` (UTC unless an offset is given), or `30m`, `12h`, `7d`
    ago."""
    relative = _RELATIVE.match(text.strip())
    if relative:
        amount, unit = relative.groups()
        return timezone.now() - timedelta(**{_UNITS[unit]: float(amount)})
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected an ISO date or time (2026-11-20, 2026-11-20T08:00) "
            "or an age such as 30m, 12h or 7d"
        ) from error
    return moment if timezone.is_aware(moment) else moment.replace(tzinfo=UTC)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return value


class Command(BaseCommand):
    help = (
        "Queue dead letters that were not replayed yet again (oldest first), with the same push "
        "id; filters narrow which. Safe while the service runs."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenant", help="Only this tenant's (its short name).")
        parser.add_argument("--app", help="Only this app's (its name).")
        parser.add_argument(
            "--provider", choices=list(Service.values), help="Only sends through this provider."
        )
        parser.add_argument(
            "--reason",
            help='Only letters whose reason contains this text (e.g. "THROTTLED", "too old").',
        )
        parser.add_argument(
            "--since",
            type=since_argument,
            help="Only letters created since then: an ISO date or time (UTC unless it has an "
            "offset), or an age such as 30m, 12h or 7d.",
        )
        parser.add_argument(
            "--limit",
            type=positive,
            help="Replay at most this many, the oldest first (in the order they were recorded).",
        )
        parser.add_argument(
            "--batch-size",
            type=positive,
            default=200,
            help="Letters queued between two progress lines (default 200).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count what would be replayed, by tenant, app, provider and reason; queue "
            "nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        letters = dead_letters.pending(
            tenant=options["tenant"],
            app=options["app"],
            provider=options["provider"],
            reason=options["reason"],
            since=options["since"],
        )
        ids = list(letters.values_list("pk", flat=True)[: options["limit"]])
        if options["dry_run"]:
            self._show(letters, ids)
            return
        replayed = 0
        batch_size = options["batch_size"]
        for start in range(0, len(ids), batch_size):
            try:
                replayed += dead_letters.replay(dead_letter_ids=ids[start : start + batch_size])
            except QueueUnavailable as error:
                raise CommandError(
                    f"the queue is unavailable: {replayed} of {len(ids)} dead letter(s) were "
                    "replayed; run the command again to replay the rest"
                ) from error
            if len(ids) > batch_size:
                self.stdout.write(f"replayed {replayed} of {len(ids)}")
                self.stdout.flush()
        skipped = len(ids) - replayed
        note = f" ({skipped} replayed by someone else meanwhile)" if skipped else ""
        self.stdout.write(f"replayed {replayed} dead letter(s){note}")

    def _show(self, letters: QuerySet[DeadLetter], ids: list[int]) -> None:
        if not ids:
            self.stdout.write("dry run: no dead letter matches; none would be replayed")
            return
        groups = (
            letters.filter(pk__lte=ids[-1])  # the ids are the oldest matches: pk order
            .values("tenant__name", "app__name", "provider", "reason")
            .annotate(count=Count("pk"))
            .order_by("tenant__name", "app__name", "provider", "reason")
        )
        for group in groups:
            self.stdout.write(
                f"{group['count']:>8}  {group['tenant__name']}/{group['app__name']} "
                f"{group['provider']} {group['reason']}"
            )
        self.stdout.write(f"dry run: {len(ids)} dead letter(s) would be replayed; none was")
