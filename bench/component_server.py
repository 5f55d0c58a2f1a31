"""The XMPP-server end of an XEP-0114 link, lean enough to drive the gateway at full speed.

The benchmark accepts the gateway's component connection itself (as Prosody or ejabberd
would) and pipelines publishes into it, so what it measures is our gateway, not a server.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
import xml.etree.ElementTree as ET

STREAM_NS = "http://etherx.jabber.org/streams"
ACCEPT_NS = "jabber:component:accept"

PUBLISH = (
    "<iq type='set' from='{domain}' to='{component}' id='{id}'>"
    "<pubsub xmlns='http://jabber.org/protocol/pubsub'><publish node='{node}'><item>"
    "<notification xmlns='urn:xmpp:push:0'><x xmlns='jabber:x:data' type='form'>"
    "<field var='FORM_TYPE' type='hidden'><value>urn:xmpp:push:summary</value></field>"
    "<field var='message-count' type='text-single'><value>1</value></field>"
    "<field var='last-message-body' type='text-single'><value>New Message!</value></field>"
    "</x></notification></item></publish><publish-options>"
    "<x xmlns='jabber:x:data' type='submit'><field var='FORM_TYPE'>"
    "<value>http://jabber.org/protocol/pubsub#publish-options</value></field>"
    "<field var='secret'><value>{secret}</value></field></x></publish-options></pubsub></iq>"
)


class ComponentServer:
    """Accepts one component connection, then sends publishes and times their answers."""

    def __init__(self, component_jid: str, secret: str, domain: str = "localhost") -> None:
        self.component_jid = component_jid
        self.secret = secret
        self.domain = domain
        self.port = 0
        self.sent_at: dict[str, float] = {}
        self.answered_at: dict[str, float] = {}
        self.answer_types: dict[str, str] = {}
        self._connected = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self._window: asyncio.Semaphore | None = None
        self._all_answered = asyncio.Event()
        self._expected = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def connected(self) -> bool:
        """The component's handshake passed."""
        return self._connected.is_set()

    async def wait_connected(self, timeout: float) -> None:
        await asyncio.wait_for(self._connected.wait(), timeout)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = ET.XMLPullParser(("start", "end"))
        stream_id = secrets.token_hex(8)
        depth = 0
        authenticated = False
        while data := await reader.read(65536):
            parser.feed(data)
            for event, element in parser.read_events():
                if event == "start":
                    depth += 1
                    if depth == 1:
                        header = (
                            f"<?xml version='1.0'?><stream:stream xmlns:stream='{STREAM_NS}' "
                            f"xmlns='{ACCEPT_NS}' from='{self.component_jid}' id='{stream_id}'>"
                        )
                        writer.write(header.encode())
                    continue
                depth -= 1
                if depth != 1:
                    continue
                tag = element.tag.rsplit("}", 1)[-1]
                if tag == "handshake" and not authenticated:
                    expected = hashlib.sha1((stream_id + self.secret).encode()).hexdigest()
                    if (element.text or "").strip() != expected:
                        writer.write(
                            b"<stream:error><not-authorized xmlns='urn:ietf:params:xml:ns:"
                            b"xmpp-streams'/></stream:error></stream:stream>"
                        )
                        writer.close()
                        return
                    authenticated = True
                    writer.write(b"<handshake/>")
                    self._writer = writer
                    self._connected.set()
                elif tag == "iq":
                    self._answered(element.get("id", ""), element.get("type", ""))
                element.clear()

    def _answered(self, iq_id: str, iq_type: str) -> None:
        if iq_id not in self.sent_at or iq_id in self.answered_at:
            return
        self.answered_at[iq_id] = time.perf_counter()
        self.answer_types[iq_id] = iq_type
        if self._window is not None:
            self._window.release()
        if len(self.answered_at) >= self._expected:
            self._all_answered.set()

    async def publish_all(
        self, nodes: list[tuple[str, str, str]], *, window: int, timeout: float
    ) -> None:
        """Send one publish per (iq id, node, secret), keeping at most `window` unanswered."""
        assert self._writer is not None
        self._window = asyncio.Semaphore(window)
        self._expected = len(nodes)
        self._all_answered.clear()
        for iq_id, node, secret in nodes:
            await self._window.acquire()
            self.sent_at[iq_id] = time.perf_counter()
            self._writer.write(
                PUBLISH.format(
                    domain=self.domain,
                    component=self.component_jid,
                    id=iq_id,
                    node=node,
                    secret=secret,
                ).encode()
            )
            await self._writer.drain()
        await asyncio.wait_for(self._all_answered.wait(), timeout)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.write(b"</stream:stream>")
            self._writer.close()
        if self._server is not None:
            self._server.close()
