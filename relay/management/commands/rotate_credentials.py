"""`manage.py rotate_credentials`: re-encrypt stored credentials with the current key.

Put the new key first in CREDENTIAL_KEYS (keep the old ones after it), restart, run this, then
drop the old keys. Safe while the service runs.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from relay.services.credentials.keys import credential_key_status, rotate_credentials


class Command(BaseCommand):
    help = "Re-encrypt every stored credential with the first CREDENTIAL_KEYS entry."

    def handle(self, *args: Any, **options: Any) -> None:
        count = rotate_credentials()
        self.stdout.write(f"re-encrypted {count} credential value(s) with the current key")
        status = credential_key_status()
        if status.unreadable:
            raise CommandError(
                f"{status.unreadable} stored credential value(s) cannot be decrypted with any "
                "configured key: add the missing key to CREDENTIAL_KEYS, or enter them again"
            )
