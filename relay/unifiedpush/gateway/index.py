"""What the direct path must not overtake or send to: which phones have stored messages, which
phones have messages on their way into the store, and which endpoints are revoked.

Read from the database when a link comes up and every INDEX_SECONDS, and kept current between
reads from what passes through the gateway; it errs only towards declining the direct path
(a message ended elsewhere, by DELETE or expiry, stays marked until its phone is read again).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relay.unifiedpush.gateway.phones import PhoneKey

INDEX_SECONDS = 30.0


@dataclass
class StoredIndex:
    stored_ids: dict[PhoneKey, set[int]] = field(default_factory=dict)
    stored_key: dict[int, PhoneKey] = field(default_factory=dict)
    # Phones whose messages we declined: the web process is storing them, and until we have
    # seen them stored (their wake-up or a sweep) the phone stays on the stored path.
    awaiting: dict[PhoneKey, int] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)
    indexed: set[int] = field(default_factory=set)  # components read since their link came up
    _log: list[tuple[str, Any]] | None = None  # what passed while a read was under way
    _last_read: float = 0.0

    # --- kept current from what passes

    def mark(self, key: PhoneKey, message_id: int) -> None:
        self.stored_ids.setdefault(key, set()).add(message_id)
        self.stored_key[message_id] = key
        if self._log is not None:
            self._log.append(("mark", (key, message_id)))

    def unmark(self, message_id: int) -> PhoneKey | None:
        key = self.stored_key.pop(message_id, None)
        if key is not None:
            ids = self.stored_ids.get(key)
            if ids is not None:
                ids.discard(message_id)
                if not ids:
                    del self.stored_ids[key]
        if self._log is not None:
            self._log.append(("unmark", message_id))
        return key

    def seen_stored(self, key: PhoneKey, message_id: int) -> None:
        """A stored message seen: marked, and if seen for the first time, one decline less."""
        if message_id not in self.stored_key:
            self._one_less(key)
        self.mark(key, message_id)

    def declined(self, key: PhoneKey) -> None:
        """The web process stores this phone's message: the phone stays on the stored path."""
        self.awaiting[key] = self.awaiting.get(key, 0) + 1
        if self._log is not None:
            self._log.append(("await", key))

    def _one_less(self, key: PhoneKey) -> None:
        count = self.awaiting.get(key, 0)
        if count > 1:
            self.awaiting[key] = count - 1
        elif count:
            del self.awaiting[key]
        if self._log is not None:
            self._log.append(("seen", key))

    def note_revoked(self, endpoint_key: str) -> None:
        self.revoked.add(endpoint_key)
        if self._log is not None:
            self._log.append(("revoked", endpoint_key))

    def link_down(self, component_id: int) -> None:
        self.indexed.discard(component_id)

    # --- questions

    def holds(self, key: PhoneKey) -> bool:
        """The phone has stored messages, or messages on their way into the store."""
        return bool(self.stored_ids.get(key) or self.awaiting.get(key))

    def older_waiting(self, key: PhoneKey, message_id: int, known: set[int]) -> bool:
        """Older stored messages of this phone that are not on their way to it."""
        return any(other < message_id and other not in known for other in self.stored_ids[key])

    def only_ended_elsewhere(self, key: PhoneKey, known: set[int]) -> bool:
        """Marks remain but none is a message we sent: they may have ended elsewhere."""
        ids = self.stored_ids.get(key)
        return ids is not None and bool(ids) and not ids & known

    def marked(self, component_id: int, recipient_keys: Iterable[str]) -> set[int]:
        return {
            message_id
            for recipient_key in recipient_keys
            for message_id in self.stored_ids.get((component_id, recipient_key), ())
        }

    def due(self, held: Iterable[int]) -> bool:
        """Whether to read again: a held link not read since it came up, or a while since."""
        return bool(set(held) - self.indexed) or time.monotonic() - self._last_read > INDEX_SECONDS

    # --- reading it again

    def begin_read(self) -> None:
        self._log = []

    def abandon_read(self) -> None:
        self._log = None

    def finish_read(
        self,
        rows: Sequence[tuple[int, int, str]],
        revoked: set[str],
        *,
        component_ids: Sequence[int],
        held: Iterable[int],
    ) -> None:
        """What the database said (stored messages as (id, component, recipient key), live
        revocations), with what passed here meanwhile applied on top."""
        log_since, self._log = self._log or [], None
        self.stored_ids, self.stored_key, self.awaiting = {}, {}, {}
        for message_id, component_id, recipient_key in rows:
            self.mark((component_id, recipient_key), message_id)
        for action, value in log_since:
            if action == "mark":
                key, message_id = value
                self.mark(key, message_id)
            elif action == "unmark":
                self.unmark(value)
            elif action == "await":
                self.declined(value)
            elif action == "seen":
                self._one_less(value)
        self.revoked = revoked | {key for action, key in log_since if action == "revoked"}
        self.indexed = set(component_ids) & set(held)
        self._last_read = time.monotonic()
