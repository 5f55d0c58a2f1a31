"""UnifiedPush's system checks: keys that cannot serve, a direct path misconfigured. Their ids
(relay.E010-E012, relay.W030) are those operators already know."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning, register
from django.db import DatabaseError

from relay import conf


@register("relay")
def unifiedpush_keys_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """UNIFIEDPUSH_KEYS must be 32-byte keys; stored messages sealed with a key that is no
    longer configured cannot be delivered (the key was dropped before they expired)."""
    from relay.unifiedpush.services import keys

    entries = list(conf.current().unifiedpush_keys)
    if not entries:
        return [Error("UNIFIEDPUSH_KEYS is empty: no endpoint can be issued.", id="relay.E010")]
    for index, entry in enumerate(entries):
        try:
            keys.decode_master_key(entry)
        except keys.BadKey as error:
            return [
                Error(
                    f"UNIFIEDPUSH_KEYS entry {index + 1} is not base64 of 32 bytes ({error}).",
                    hint="Generate one with: python -c 'import base64, os; "
                    "print(base64.urlsafe_b64encode(os.urandom(32)).decode())'",
                    id="relay.E011",
                )
            ]
    from relay.unifiedpush.services import store

    try:
        unreadable = store.count_sealed_with_other_keys([key.kid for key in keys.keyring().keys])
    except DatabaseError:
        return []
    if unreadable:
        return [
            Warning(
                f"{unreadable} stored UnifiedPush message(s) are sealed with a key that is not "
                "in UNIFIEDPUSH_KEYS; they cannot be delivered.",
                hint="Put the old key back (after the new one) until they expire.",
                id="relay.W030",
            )
        ]
    return []


@register("relay")
def unifiedpush_direct_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The direct path's window and listener: a wrong value would only show at the first POST."""
    from relay.unifiedpush.services.channel import parse_bind

    relay = conf.current()
    messages: list[CheckMessage] = []
    if not 0 <= relay.unifiedpush_direct_seconds <= relay.unifiedpush_answer_timeout_seconds:
        messages.append(
            Error(
                "RELAY_UNIFIEDPUSH_DIRECT_SECONDS must be between 0 (off) and "
                "RELAY_UNIFIEDPUSH_ANSWER_TIMEOUT_SECONDS.",
                id="relay.E012",
            )
        )
    try:
        parse_bind(relay.unifiedpush_channel)
    except ValueError:
        messages.append(
            Error(
                "RELAY_UNIFIEDPUSH_CHANNEL must be host:port (port 0 picks a free one), or off.",
                id="relay.E012",
            )
        )
    return messages
