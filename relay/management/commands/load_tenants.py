"""`manage.py load_tenants FILE.yaml`: apply tenants, apps and components from a file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from relay.services.provisioning import ProvisioningError, load_tenants


class Command(BaseCommand):
    help = "Create or update tenants, apps and components from a YAML file (idempotent)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("file", type=Path)

    def handle(self, *args: Any, **options: Any) -> None:
        path: Path = options["file"]
        try:
            document = path.read_text()
        except OSError as error:
            raise CommandError(f"cannot read {path}: {error.strerror}") from error
        try:
            report = load_tenants(document, base_dir=path.resolve().parent)
        except ProvisioningError as error:
            raise CommandError(f"{path}: {error}") from error
        self.stdout.write(f"{path}: {report.summary()}")
