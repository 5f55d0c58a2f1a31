"""`manage.py end_sessions USERNAME`: log a staff member out everywhere. Audited."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from relay.operators.services import sessions


class Command(BaseCommand):
    help = "End every admin session of a user."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model()._default_manager.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"no user {options['username']!r}")
        sessions.end_everywhere(user, reason="ended from the command line")
        self.stdout.write(f"every session of {user.get_username()} is ended")
