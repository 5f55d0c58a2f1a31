"""One XEP-0114 link: a slixmpp component whose every iq goes through `handlers.dispatch`."""

from __future__ import annotations

import asyncio
import logging
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from typing import Any

from slixmpp import ComponentXMPP
from slixmpp.jid import JID, InvalidJID
from slixmpp.stanza import Iq
from slixmpp.xmlstream.handler import CoroutineCallback
from slixmpp.xmlstream.matcher.base import MatcherBase

from relay.models import Component
from xmppgateway import handlers

log = logging.getLogger(__name__)

# A hook that takes a raw stanza before slixmpp sees it; True means it was consumed.
StanzaHook = Callable[[ET.Element], bool]
_IQ = "{jabber:component:accept}iq"
_PRESENCE = "{jabber:component:accept}presence"


class AnyIq(MatcherBase):
    """Matches every iq, so that slixmpp never answers one on its own."""

    def __init__(self) -> None:
        super().__init__(None)

    def match(self, stanza: Any) -> bool:
        return isinstance(stanza, Iq)


class PushComponent(ComponentXMPP):
    def __init__(
        self,
        component: Component,
        *,
        run_blocking: handlers.RunBlocking,
        max_field_length: int,
        answer_timeout: float = 15.0,
        accept_publish: handlers.AcceptPublish | None = None,
        iq_set_handlers: Mapping[str, handlers.IqHandler] | None = None,
        on_iq_answer: StanzaHook | None = None,
        on_presence: StanzaHook | None = None,
    ) -> None:
        # fix_error_ns: without it Prosody cannot parse our errors and counts even `wait` ones.
        super().__init__(
            component.jid, component.secret, component.host, component.port, fix_error_ns=True
        )
        self.context = handlers.LinkContext(
            component=component,
            max_field_length=max_field_length,
            run_blocking=run_blocking,
            accept_publish=accept_publish,
            iq_set_handlers=iq_set_handlers or {},
        )
        self.on_iq_answer = on_iq_answer
        self.on_presence = on_presence
        self.answer_timeout = answer_timeout
        self.in_flight: set[asyncio.Task[Any]] = set()
        self.register_handler(CoroutineCallback("relay iq", AnyIq(), self._on_iq))

    def _spawn_event(self, xml: ET.Element) -> None:
        """UnifiedPush answers and presences are taken here, before slixmpp builds a stanza
        object and matches it against every handler: that costs more than relaying the push.
        (`_spawn_event` is slixmpp's own step from parsed XML to handlers; this override is
        the one place we reach into it, and the UnifiedPush end-to-end tests cover it.)"""
        tag = xml.tag
        if tag == _IQ:
            if (
                self.on_iq_answer is not None
                and xml.get("type") in ("result", "error")
                and self.on_iq_answer(xml)
            ):
                return
        elif tag == _PRESENCE and self.on_presence is not None and self.on_presence(xml):
            return
        super()._spawn_event(xml)

    async def _on_iq(self, iq: Iq) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.in_flight.add(task)
        try:
            await self._answer(iq)
        finally:
            if task is not None:
                self.in_flight.discard(task)

    async def _answer(self, iq: Iq) -> None:
        iq_type = iq.xml.get("type", "")
        if iq_type not in {"get", "set"}:
            return  # results and errors are never answered
        try:
            sender = JID(iq.xml.get("from", ""))
        except InvalidJID:
            sender = JID()
        children = list(iq.xml)
        payload = children[0] if len(children) == 1 else None
        try:
            answer = await asyncio.wait_for(
                handlers.dispatch(self.context, iq_type, sender, payload), self.answer_timeout
            )
        except TimeoutError:
            answer = handlers.error(*handlers.TRY_LATER)
        except Exception as error:  # a bug must not cost users their registrations
            log.exception("gateway.handler_crashed", extra={"error_type": type(error).__name__})
            answer = handlers.error(*handlers.TRY_LATER)
        self._send_answer(iq, answer)

    def _send_answer(self, iq: Iq, answer: handlers.Answer) -> None:
        reply = iq.reply(clear=True)
        if answer.is_error:
            reply["type"] = "error"
            reply["error"]["type"] = answer.error_type
            reply["error"]["condition"] = answer.condition
            if answer.text:
                reply["error"]["text"] = answer.text
        elif answer.payload is not None:
            reply.xml.append(answer.payload)
        reply.send()
