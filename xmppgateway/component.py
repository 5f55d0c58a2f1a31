"""One XEP-0114 link: every get/set iq goes through `handlers.dispatch` and gets one answer.

Answers are written here, not through slixmpp's `Iq.reply`, which parses `from` and `to` as
JIDs and raises on a malformed one, so a hostile sender got no answer at all. A request is
judged synchronously as it is read (xmppgateway.stream); only what needs a service call becomes
a task, and at most `max_in_flight` of those per link: beyond it the link answers `wait`
(`resource-constraint`), so one link's flood cannot grow the gateway's memory or starve the
other links.
"""

from __future__ import annotations

import asyncio
import logging
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slixmpp.jid import JID, InvalidJID

from relay.models import Component
from xmppgateway import handlers
from xmppgateway.stream import ACCEPT_NS, GuardedStream, StreamLimits

log = logging.getLogger(__name__)

# A hook that takes a raw stanza the gateway routes to a feature (xmppgateway.features); True
# means it was taken.
StanzaHook = Callable[[ET.Element], bool]

STANZAS_NS = "urn:ietf:params:xml:ns:xmpp-stanzas"
# Error answers are counted per link and logged as one line at most this often.
ERROR_SUMMARY_SECONDS = 60.0
BUSY = handlers.error(*handlers.SLOW_DOWN, "too many requests in flight on this link")


@dataclass(frozen=True, slots=True)
class Asker:
    """What an answer needs of its iq (kept instead of the iq while a request waits)."""

    sender: str | None
    to: str
    iq_id: str | None

    @classmethod
    def of(cls, iq: ET.Element) -> Asker:
        return cls(iq.get("from"), iq.get("to", ""), iq.get("id"))


def reply_xml(asker: Asker, answer: handlers.Answer, component_jid: str) -> bytes:
    """The answer to an iq, addressed back to whatever its `from` said (escaped, never parsed)."""
    attributes = [("type", "error" if answer.is_error else "result")]
    if asker.sender:
        attributes.append(("to", asker.sender))
    attributes.append(("from", _our_address(asker.to, component_jid)))
    if asker.iq_id is not None:
        attributes.append(("id", asker.iq_id))
    head = "<iq" + "".join(f" {name}={quoteattr(value)}" for name, value in attributes)
    if answer.is_error:
        # In the stream's namespace (what slixmpp's fix_error_ns did): Prosody needs it.
        body = (
            f"<error type={quoteattr(answer.error_type)}><{answer.condition} xmlns='{STANZAS_NS}'/>"
        )
        if answer.text:
            body += f"<text xmlns='{STANZAS_NS}'>{escape(answer.text)}</text>"
        body += "</error>"
    elif answer.payload is not None:
        body = _element_xml(answer.payload, ACCEPT_NS)
    else:
        return (head + "/>").encode()
    return (head + ">" + body + "</iq>").encode()


def _element_xml(element: ET.Element, parent_ns: str) -> str:
    """Our own payloads (disco, command results): a namespace is declared where it changes.
    (slixmpp's `tostring` escapes character by character, slow on long attributes.)"""
    ns, _, name = element.tag[1:].partition("}") if element.tag[0] == "{" else ("", "", element.tag)
    parts = [f"<{name}"]
    if ns != parent_ns:
        parts.append(f" xmlns={quoteattr(ns)}")
    parts += [f" {key}={quoteattr(value)}" for key, value in element.attrib.items()]
    children = [_element_xml(child, ns) for child in element]
    if not children and not element.text:
        parts.append("/>")
    else:
        parts += [">", escape(element.text or ""), *children, f"</{name}>"]
    return "".join(parts)


def escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def quoteattr(value: str) -> str:
    """An attribute value in double quotes; line breaks and tabs kept as character references."""
    value = escape(value).replace('"', "&quot;")
    if "\n" in value or "\r" in value or "\t" in value:
        value = value.replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")
    return f'"{value}"'


def _our_address(to: str, component_jid: str) -> str:
    """Answer from the address asked if it is ours; the server refuses any other `from`."""
    if to == component_jid:
        return to
    try:
        return to if JID(to).domain == component_jid else component_jid
    except InvalidJID:
        return component_jid


class PushComponent(GuardedStream):
    def __init__(
        self,
        component: Component,
        *,
        run_blocking: handlers.RunBlocking,
        max_field_length: int,
        limits: StreamLimits | None = None,
        max_in_flight: int = 1000,
        answer_timeout: float = 15.0,
        accept_publish: handlers.AcceptPublish | None = None,
        iq_set_handlers: Mapping[str, handlers.IqHandler] | None = None,
        disco_features: handlers.DiscoFeatures | None = None,
        on_iq_answer: StanzaHook | None = None,
        on_presence: StanzaHook | None = None,
    ) -> None:
        # fix_error_ns: without it Prosody cannot parse slixmpp's own errors and counts even
        # `wait` ones (ours are written by reply_xml).
        super().__init__(
            component.jid,
            component.secret,
            component.host,
            component.port,
            fix_error_ns=True,
            limits=limits or StreamLimits(),
        )
        self.context = handlers.LinkContext(
            component=component,
            max_field_length=max_field_length,
            run_blocking=run_blocking,
            accept_publish=accept_publish,
            iq_set_handlers=iq_set_handlers or {},
            disco_features=disco_features or handlers.no_disco_features,
        )
        self._on_iq_answer = on_iq_answer
        self._on_presence = on_presence
        self.max_in_flight = max(1, max_in_flight)
        self.answer_timeout = answer_timeout
        self.in_flight: set[asyncio.Task[Any]] = set()
        self.errors_answered: Counter[str] = Counter()
        self._next_summary = 0.0

    def on_answer(self, iq: ET.Element) -> bool:
        return self._on_iq_answer is not None and self._on_iq_answer(iq)

    def on_presence(self, presence: ET.Element) -> None:
        if self._on_presence is not None:
            self._on_presence(presence)

    def on_request(self, iq: ET.Element) -> None:
        children = list(iq)
        payload = children[0] if len(children) == 1 else None
        try:
            outcome = handlers.dispatch(
                self.context, iq.get("type", ""), iq.get("from", ""), payload
            )
        except Exception as error:  # a bug must neither go unanswered nor end the link
            log.exception("gateway.handler_crashed", extra={"error_type": type(error).__name__})
            outcome = handlers.error(*handlers.TRY_LATER)
        asker = Asker.of(iq)
        if isinstance(outcome, handlers.Answer):
            self._send_answer(asker, outcome)
            return
        if len(self.in_flight) >= self.max_in_flight:
            outcome.close()
            self._send_answer(asker, BUSY)
            return
        task = asyncio.ensure_future(self._finish(asker, outcome))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    async def _finish(self, asker: Asker, pending: handlers.Pending) -> None:
        try:
            async with asyncio.timeout(self.answer_timeout):
                answer = await pending
        except TimeoutError:
            answer = handlers.error(*handlers.TRY_LATER)
        except Exception as error:  # a bug must not cost users their registrations
            log.exception("gateway.handler_crashed", extra={"error_type": type(error).__name__})
            answer = handlers.error(*handlers.TRY_LATER)
        self._send_answer(asker, answer)

    def _send_answer(self, asker: Asker, answer: handlers.Answer) -> None:
        if answer.is_error:
            self._count_error(answer)
        transport = self.transport
        if transport is None or transport.is_closing():
            return  # the link is gone; the server times the request out and retries
        transport.write(reply_xml(asker, answer, self.context.component.jid))

    def _count_error(self, answer: handlers.Answer) -> None:
        """One log line per link and minute for error answers, not one per hostile stanza."""
        self.errors_answered[f"{answer.error_type}/{answer.condition}"] += 1
        now = time.monotonic()
        if now >= self._next_summary:
            log.info(
                "link.errors_answered",
                extra={
                    "component_id": self.context.component.pk,
                    "errors": dict(self.errors_answered),
                },
            )
            self.errors_answered.clear()
            self._next_summary = now + ERROR_SUMMARY_SECONDS
