"""`manage.py run_reports [--since DAY] [--until DAY] [--master URL] [--force]`."""

from __future__ import annotations

from datetime import date
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from relay.services import reports


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise CommandError(f"not a day (YYYY-MM-DD): {text!r}") from None


class Command(BaseCommand):
    help = (
        "Run the Spark reports over the read replica (ANALYTICS_DATABASE_URL) for the given "
        "days (default: yesterday and today) on local[*] or the given Spark master."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--since", type=_day, help="first day, YYYY-MM-DD (UTC)")
        parser.add_argument("--until", type=_day, help="last day, YYYY-MM-DD (UTC)")
        parser.add_argument("--master", help="Spark master URL, e.g. spark://host:7077")
        parser.add_argument("--force", action="store_true", help="recompute unchanged days")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            reports.run_reports(
                since=options["since"],
                until=options["until"],
                master=options["master"],
                force=options["force"],
                output=lambda line: self.stdout.write(line),
            )
        except reports.ReportsRefused as error:
            raise CommandError(f"the reports cannot run: {error}") from None
        except reports.ReportsFailed as error:
            raise CommandError(f"the reports failed:\n{error}") from None
