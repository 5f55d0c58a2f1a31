"""`manage.py environment [--write | --check]`: `.env.example` and docs/configuration.md's
table, generated from the declarations in relay/environment.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from relay import environment

BEGIN = "<!-- generated from relay/environment.py: manage.py environment --write -->"
END = "<!-- end of the generated table -->"


def generated(root: Path) -> dict[Path, str]:
    """Each generated file's path and the text it must have."""
    docs = root / "docs" / "configuration.md"
    text = docs.read_text() if docs.exists() else f"{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    table = f"{BEGIN}\n{environment.configuration_table()}{END}"
    return {root / ".env.example": environment.env_example(), docs: head + table + tail}


class Command(BaseCommand):
    help = "Print .env.example; --write it and docs/configuration.md's table, --check them."

    def add_arguments(self, parser: CommandParser) -> None:
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument("--write", action="store_true", help="rewrite the generated files")
        mode.add_argument("--check", action="store_true", help="fail if they are out of date")

    def handle(self, *args: Any, **options: Any) -> None:
        files = generated(Path(settings.BASE_DIR))
        if options["write"]:
            for path, text in files.items():
                path.write_text(text)
                self.stdout.write(f"wrote {path.relative_to(settings.BASE_DIR)}")
        elif options["check"]:
            stale = [str(p.relative_to(settings.BASE_DIR)) for p, t in files.items()
                     if not p.exists() or p.read_text() != t]  # fmt: skip
            if stale:
                raise CommandError(f"out of date, run `manage.py environment --write`: {stale}")
        else:
            self.stdout.write(environment.env_example(), ending="")
