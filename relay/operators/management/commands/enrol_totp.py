"""`manage.py enrol_totp USERNAME`: give a staff member an authenticator app (TOTP) and fresh
recovery codes from the command line: the first operator of a headless install, or a staff
member whose devices were reset. Prints the key once; recorded in the audit trail."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from relay.operators.services import second_factor


class Command(BaseCommand):
    help = "Add an authenticator app (TOTP) and new recovery codes for a staff member."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="authenticator", help="The device's name.")

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model()._default_manager.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"no user {options['username']!r}")
        if not user.is_staff:
            raise CommandError(f"{user.get_username()!r} is not staff: the admin is closed to them")
        key = second_factor.new_totp_key()
        second_factor.enrol_totp(user, key, name=options["name"])
        codes = second_factor.new_recovery_codes(user)
        self.stdout.write(f"key (type into the app): {second_factor.secret_base32(key)}")
        self.stdout.write(f"uri (or scan it): {second_factor.totp_uri(user, key)}")
        self.stdout.write("recovery codes (each works once; keep them apart from the phone):")
        for code in codes:
            self.stdout.write(f"  {code}")
