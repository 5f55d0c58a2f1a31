"""`manage.py reset_devices USERNAME`: remove every second factor of a staff member (a lost
phone or key) and end their sessions; at their next login they enrol anew. Audited."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from relay.operators.services import second_factor, sessions


class Command(BaseCommand):
    help = "Remove a staff member's second factors and end their sessions."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model()._default_manager.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"no user {options['username']!r}")
        removed = second_factor.reset_devices(user)
        sessions.end_everywhere(user, reason="second factor reset")
        self.stdout.write(
            f"removed {removed} device(s) of {user.get_username()}; their sessions are ended "
            "and they enrol a device at their next login"
        )
