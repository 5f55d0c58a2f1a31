"""`manage.py load_tenants FILE.yaml`: apply tenants, apps and components from a file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from relay.services.provisioning import ProvisioningError, load_tenants


class Command(BaseCommand):
    help = (
        "Create or update tenants, apps and components from a YAML file (idempotent; the whole "
        "file applies or nothing does). See tenants.example.yaml."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "file",
            type=Path,
            help="The YAML document; files it names are read relative to its folder.",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Show what would be created, updated or left unchanged (secrets masked) and "
            "change nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path: Path = options["file"]
        try:
            document = path.read_text()
        except OSError as error:
            raise CommandError(f"cannot read {path}: {error.strerror}") from error
        try:
            report = load_tenants(
                document, base_dir=path.resolve().parent, dry_run=options["dry_run"]
            )
        except ProvisioningError as error:
            raise CommandError(f"{path}: {error}") from error
        if report.dry_run:
            for change in report.changes:
                self.stdout.write(change.describe())
            self.stdout.write(f"{path}: dry run, nothing changed; would apply: {report.summary()}")
        else:
            self.stdout.write(f"{path}: {report.summary()}")
