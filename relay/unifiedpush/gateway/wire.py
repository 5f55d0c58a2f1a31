"""What goes over a link and in batches: the `<push>` iq, the phone's error condition, a
link's writes gathered per turn of the event loop, and writes to the database gathered."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from xml.sax.saxutils import quoteattr

from relay.unifiedpush.services import UP_NS, messages
from xmppgateway.features import Sender

COMPONENT_NS = "jabber:component:accept"
ERROR_TAG = f"{{{COMPONENT_NS}}}error"
STANZAS_NS = "urn:ietf:params:xml:ns:xmpp-stanzas"

BATCH_WINDOW = 0.02  # seconds an item waits to be written with others
BATCH_MAX = 500

T = TypeVar("T")


@dataclass(slots=True)
class Batch(Generic[T]):
    """Items written together: BATCH_MAX of them, or BATCH_WINDOW after the first."""

    write: Callable[[list[T]], Any]
    items: list[T] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None

    def add(self, item: T) -> None:
        self.items.append(item)
        if len(self.items) >= BATCH_MAX:
            self.flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(BATCH_WINDOW, self.flush)

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.items:
            items, self.items = self.items, []
            self.write(items)


@dataclass(slots=True)
class Link:
    """A held component link. Pushes queued in one turn of the event loop leave in one
    write: a write is a system call here and a read in the XMPP server, and under load many
    pushes are ready in the same turn."""

    sender: Sender
    component_jid: str
    pending: list[bytes] = field(default_factory=list)

    def send(self, data: bytes) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append(data)

    def push(self, iq_id: str, opened: messages.Opened) -> None:
        self.send(
            push_iq(
                iq_id=iq_id,
                component_jid=self.component_jid,
                jid=opened.jid,
                application=opened.application,
                instance=opened.instance,
                body=opened.body,
            )
        )

    def flush(self) -> None:
        if self.pending:
            data = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
            self.pending.clear()
            with contextlib.suppress(Exception):  # a link that went: its pushes go again
                self.sender.send_raw(data)


def push_iq(
    *, iq_id: str, component_jid: str, jid: str, application: bytes, instance: bytes, body: bytes
) -> bytes:
    """The `<push>` iq of the `up` protocol, as bytes for the transport."""
    return (
        f"<iq type='set' id='{iq_id}' from={quoteattr(component_jid)} to={quoteattr(jid)}>"
        f"<push xmlns='{UP_NS}' application='{base64.b64encode(application).decode()}' "
        f"instance='{base64.b64encode(instance).decode()}'>{base64.b64encode(body).decode()}"
        "</push></iq>"
    ).encode()


def error_condition(iq: ET.Element) -> str | None:
    error = iq.find(ERROR_TAG)
    if error is None:
        return None
    for child in error:
        if child.tag.startswith(f"{{{STANZAS_NS}}}") and not child.tag.endswith("}text"):
            return child.tag.split("}", 1)[1]
    return None
