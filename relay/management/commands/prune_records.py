"""`manage.py prune_records [--days N] [--batch-size N]`: delete report records past retention."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from relay.services import retention


class Command(BaseCommand):
    help = (
        "Delete delivery records, UnifiedPush delivery records, registration events, "
        "publish tallies and audit entries older than RELAY_RETENTION_DAYS, in small "
        "batches (safe while the relay runs)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--days", type=int, default=None, help="override the retention")
        parser.add_argument("--batch-size", type=int, default=10_000, help="ids per delete")

    def handle(self, *args: Any, **options: Any) -> None:
        def progress(step: retention.Progress) -> None:
            percent = 100 * step.done_ids // max(step.total_ids, 1)
            self.stdout.write(f"{step.table}: {step.deleted} deleted ({percent}% of the range)")

        pruned = retention.prune(
            days=options["days"], batch_size=options["batch_size"], progress=progress
        )
        if not pruned:
            self.stdout.write("retention is off (RELAY_RETENTION_DAYS <= 0): nothing pruned")
        for table, count in pruned.items():
            self.stdout.write(f"{table}: {count} row(s) pruned")
