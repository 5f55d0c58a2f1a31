"""XMPP test clients for synchronous pytest code, against the real servers of xmpp_servers.py.

``XmppTestClient`` wraps a slixmpp ``ClientXMPP`` that runs on its own asyncio event loop in
a background thread; every public method blocks with a timeout. Stanzas come back as
``xml.etree.ElementTree.Element`` objects (copies, namespaced: ``{jabber:client}iq``).

``RawXmppStream`` is a blocking, minimal XML stream over a plain socket, used for in-band
registration and to speak XEP-0114 by hand in tests.

The clients never touch ``fix_error_ns`` (a slixmpp global the component under test uses);
run the component under test in another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import secrets
import socket
import ssl
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol, Self, TypeVar
from xml.sax.saxutils import escape, quoteattr

from slixmpp import ClientXMPP
from slixmpp.exceptions import IqError, IqTimeout
from slixmpp.stanza import Iq
from slixmpp.xmlstream import StanzaBase
from slixmpp.xmlstream.handler import Callback
from slixmpp.xmlstream.matcher import MatchXPath

log = logging.getLogger(__name__)

T = TypeVar("T")

CLIENT_NS = "jabber:client"
COMPONENT_NS = "jabber:component:accept"
STREAM_NS = "http://etherx.jabber.org/streams"
STREAMS_ERROR_NS = "urn:ietf:params:xml:ns:xmpp-streams"
STANZAS_ERROR_NS = "urn:ietf:params:xml:ns:xmpp-stanzas"
REGISTER_NS = "jabber:iq:register"
PUSH_NS = "urn:xmpp:push:0"
COMMANDS_NS = "http://jabber.org/protocol/commands"
DATA_FORMS_NS = "jabber:x:data"
PING_NS = "urn:xmpp:ping"
PUBLISH_OPTIONS_FORM_TYPE = "http://jabber.org/protocol/pubsub#publish-options"

DEFAULT_TIMEOUT = 30.0  # a deadline, not a wait: room for a loaded machine


class C2sEndpoint(Protocol):
    """What a client needs to know about a server (ProsodyServer and EjabberdServer fit)."""

    @property
    def domain(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def c2s_port(self) -> int: ...


class XmppClientError(RuntimeError):
    """The client could not do what was asked (authentication, stream error, ...)."""


class RegistrationError(XmppClientError):
    """In-band registration was refused; ``reply`` is the server's answer."""

    def __init__(self, message: str, reply: ET.Element | None = None) -> None:
        super().__init__(message)
        self.reply = reply


class StreamClosed(ConnectionError):
    """The peer closed the XML stream or the TCP connection."""


# --------------------------------------------------------------------------- raw streams
class RawXmppStream:
    """A blocking XML stream over a TCP socket: send text, read top-level elements.

    >>> with RawXmppStream("127.0.0.1", port) as stream:
    ...     header = stream.open("push.localhost", COMPONENT_NS, version=False)
    ...     stream.send("<handshake>...</handshake>")
    ...     reply = stream.read_element()
    """

    def __init__(self, host: str, port: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._parser = ET.XMLPullParser(events=("start", "end"))
        self._depth = 0
        self._root: ET.Element | None = None
        self._ready: list[ET.Element] = []
        self._peer_closed_stream = False

    @property
    def header(self) -> ET.Element:
        """The peer's ``<stream:stream>`` start tag (attributes only)."""
        if self._root is None:
            raise XmppClientError("the stream is not open yet")
        return self._root

    @property
    def stream_id(self) -> str:
        return self.header.get("id", "")

    def open(self, to: str, namespace: str = CLIENT_NS, *, version: bool = True) -> ET.Element:
        """Send our stream header, wait for the peer's and return it."""
        version_attr = " version='1.0'" if version else ""
        self.send(
            f"<?xml version='1.0'?><stream:stream to={quoteattr(to)} xmlns={quoteattr(namespace)}"
            f" xmlns:stream='{STREAM_NS}'{version_attr}>"
        )
        deadline = time.monotonic() + self.timeout
        while self._root is None:
            self._receive(deadline)
        return self._root

    def send(self, data: str | bytes) -> None:
        self._sock.sendall(data.encode() if isinstance(data, str) else data)

    def read_element(self, timeout: float | None = None) -> ET.Element:
        """Return the next top-level element (stanza, features, stream error, ...)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self._ready:
            if self._peer_closed_stream:
                raise StreamClosed("the peer closed the stream")
            self._receive(deadline)
        return self._ready.pop(0)

    def read_until(
        self, predicate: Callable[[ET.Element], bool], timeout: float | None = None
    ) -> ET.Element:
        """Return the first top-level element for which ``predicate`` is true."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            element = self.read_element(max(0.0, deadline - time.monotonic()))
            if predicate(element):
                return element

    def close(self) -> None:
        """Close our stream (best effort) and the socket."""
        with contextlib.suppress(OSError):
            if self._root is not None and not self._peer_closed_stream:
                self.send("</stream:stream>")
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _receive(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no data from the XMPP peer in time")
        self._sock.settimeout(remaining)
        try:
            data = self._sock.recv(65536)
        except TimeoutError:
            raise TimeoutError("no data from the XMPP peer in time") from None
        if not data:
            self._peer_closed_stream = True
            raise StreamClosed("the peer closed the TCP connection")
        self._parser.feed(data)
        for event, element in self._parser.read_events():
            if event == "start":
                if self._depth == 0:
                    self._root = element
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 1:
                    self._ready.append(element)
                    if self._root is not None:
                        self._root.remove(element)
                elif self._depth == 0:
                    self._peer_closed_stream = True


def register_account(
    server: C2sEndpoint, username: str, password: str, timeout: float = DEFAULT_TIMEOUT
) -> None:
    """Create ``username@domain`` with XEP-0077 in-band registration (pre-authentication).

    Raises RegistrationError with the server's reply when the server refuses.
    """
    with RawXmppStream(server.host, server.c2s_port, timeout) as stream:
        stream.open(server.domain)
        stream.read_until(lambda element: element.tag == f"{{{STREAM_NS}}}features")
        stream.send(
            f"<iq type='set' id='register-1'><query xmlns='{REGISTER_NS}'>"
            f"<username>{escape(username)}</username><password>{escape(password)}</password>"
            "</query></iq>"
        )
        reply = stream.read_until(
            lambda element: (
                element.tag == f"{{{CLIENT_NS}}}iq" and element.get("id") == "register-1"
            )
        )
    if reply.get("type") != "result":
        raise RegistrationError(
            f"registration of {username}@{server.domain} refused: "
            f"{ET.tostring(reply, encoding='unicode')}",
            reply,
        )


def new_username(prefix: str = "user") -> str:
    """A fresh, valid localpart."""
    return f"{prefix}-{secrets.token_hex(5)}"


# --------------------------------------------------------------------------- stanza helpers
def parse_stanza(stanza: str | ET.Element) -> ET.Element:
    """An Element in the ``jabber:client`` namespace from XML text or an Element.

    Elements without a namespace that sit in the client namespace (the stanza itself,
    ``<error>``, ``<body>``...) are put into ``jabber:client``; the input is not modified.
    """
    if isinstance(stanza, str):
        wrapper = ET.fromstring(f"<wrapper xmlns='{CLIENT_NS}'>{stanza}</wrapper>")
        if len(wrapper) != 1:
            raise ValueError("expected exactly one stanza")
        return wrapper[0]
    element = copy.deepcopy(stanza)
    _qualify(element)
    return element


def _qualify(element: ET.Element) -> None:
    if not element.tag.startswith("{"):
        element.tag = f"{{{CLIENT_NS}}}{element.tag}"
    if element.tag.startswith(f"{{{CLIENT_NS}}}"):
        for child in element:
            _qualify(child)


def error_condition(stanza: ET.Element) -> str | None:
    """The defined condition of a stanza or stream error (``"item-not-found"``), or None."""
    for error in (stanza, *stanza.iter(f"{{{CLIENT_NS}}}error")):
        for child in error:
            for namespace in (STANZAS_ERROR_NS, STREAMS_ERROR_NS):
                if child.tag.startswith(f"{{{namespace}}}") and not child.tag.endswith("}text"):
                    return child.tag.split("}", 1)[1]
    return None


def message_body(message: ET.Element) -> str | None:
    return message.findtext(f"{{{CLIENT_NS}}}body")


def form_values(element: ET.Element) -> dict[str, list[str]]:
    """The fields of the first ``jabber:x:data`` form inside ``element``: var -> values."""
    form = next(element.iter(f"{{{DATA_FORMS_NS}}}x"), None)
    if form is None:
        return {}
    return {
        field.get("var", ""): [
            value.text or "" for value in field.findall(f"{{{DATA_FORMS_NS}}}value")
        ]
        for field in form.findall(f"{{{DATA_FORMS_NS}}}field")
    }


def data_form(fields: Mapping[str, str | None], form_type: str = "submit") -> ET.Element:
    """A ``jabber:x:data`` form; a None value gives a field without ``<value>``."""
    form = ET.Element(f"{{{DATA_FORMS_NS}}}x", {"type": form_type})
    for var, value in fields.items():
        field = ET.SubElement(form, f"{{{DATA_FORMS_NS}}}field", {"var": var})
        if value is not None:
            ET.SubElement(field, f"{{{DATA_FORMS_NS}}}value").text = value
    return form


# --------------------------------------------------------------------------- the client
class XmppTestClient:
    """One XMPP account's connection, driven from synchronous test code.

    Each instance owns an asyncio loop in a daemon thread and a slixmpp ClientXMPP. No TLS
    (PLAIN/SCRAM allowed over loopback), XEP-0198 stream management on by default so that
    ``abort()`` leaves a hibernated session behind. Use as a context manager or call
    ``close()``.
    """

    def __init__(
        self,
        server: C2sEndpoint,
        username: str,
        password: str,
        *,
        resource: str | None = None,
        stream_management: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self._server = server
        self._bare_jid = f"{username}@{server.domain}"
        self.password = password
        self.timeout = timeout
        self.stream_management = stream_management
        self._inbox: list[ET.Element] = []
        self.received_messages: list[ET.Element] = []
        """Every message stanza received (copies), in order."""
        self.stream_errors: list[ET.Element] = []
        self._inbox_changed = threading.Condition()
        self._online = False
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._log_loop_exception)
        self._thread = threading.Thread(
            target=self._run_loop, name=f"xmpp-{self._bare_jid}", daemon=True
        )
        self._thread.start()
        try:
            self._xmpp: ClientXMPP = self._run(
                self._create(resource or f"pytest-{secrets.token_hex(3)}"), timeout
            )
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()
            self._closed = True
            raise

    @classmethod
    def register_account(
        cls, server: C2sEndpoint, username: str, password: str, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        """XEP-0077 in-band registration of ``username@server.domain``."""
        register_account(server, username, password, timeout)

    @classmethod
    def with_new_account(
        cls,
        server: C2sEndpoint,
        prefix: str = "user",
        *,
        connect: bool = True,
        **kwargs: Any,
    ) -> XmppTestClient:
        """Register a fresh account and return its client (connected unless told not to)."""
        username, password = new_username(prefix), secrets.token_urlsafe(12)
        register_account(server, username, password)
        client = cls(server, username, password, **kwargs)
        if connect:
            try:
                client.connect()
            except BaseException:
                client.close()
                raise
        return client

    # ----------------------------------------------------------------- identity
    @property
    def bare_jid(self) -> str:
        return self._bare_jid

    @property
    def jid(self) -> str:
        """The bare JID (``user@localhost``)."""
        return self._bare_jid

    @property
    def full_jid(self) -> str:
        """The bound full JID (``user@localhost/resource``) once connected."""
        return str(self._xmpp.boundjid.full)

    @property
    def is_connected(self) -> bool:
        return self._online and self._xmpp.transport is not None

    @property
    def sm_enabled(self) -> bool:
        """True when XEP-0198 is enabled with a resumable session id."""
        return bool(self.stream_management and self._xmpp.plugin["xep_0198"].sm_id)

    def __repr__(self) -> str:
        return f"<XmppTestClient {self._bare_jid} connected={self.is_connected}>"

    # ----------------------------------------------------------------- connection
    def connect(self, timeout: float | None = None) -> str:
        """Connect, authenticate, bind, enable XEP-0198 and send initial presence.

        After an ``abort()`` the hibernated session is resumed instead. Returns
        ``"started"`` or ``"resumed"``. When this returns the server has processed the
        presence, so messages sent to this client from now on reach it.
        """
        timeout = self.timeout if timeout is None else timeout
        return self._run(self._connect(timeout), timeout + 1)

    def disconnect(self, timeout: float | None = None) -> None:
        """Close the stream cleanly (``</stream:stream>``): the session ends, no hibernation."""
        timeout = self.timeout if timeout is None else timeout
        self._run(self._disconnect(timeout), timeout + 1)

    def abort(self, timeout: float | None = None) -> None:
        """Drop the TCP connection without closing the stream.

        With stream management on, the server keeps the session hibernated: messages for
        this account then trigger XEP-0357 pushes. ``connect()`` resumes it.
        """
        timeout = self.timeout if timeout is None else timeout
        self._run(self._abort(), timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Disconnect cleanly if connected, then stop the loop thread. Idempotent."""
        if self._closed:
            return
        try:
            if self._thread.is_alive():
                with contextlib.suppress(Exception):
                    if self.is_connected:
                        self.disconnect(timeout)
                with contextlib.suppress(Exception):
                    self._run(self._shutdown(), timeout)
        finally:
            self._closed = True
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- stanzas
    def send_iq(self, iq: str | ET.Element, timeout: float | None = None) -> ET.Element:
        """Send an ``<iq>`` (XML text or Element) and return the reply, result or error.

        An ``id`` is added when missing. Raises TimeoutError when no reply comes in time.
        """
        timeout = self.timeout if timeout is None else timeout
        element = parse_stanza(iq)
        if element.tag != f"{{{CLIENT_NS}}}iq":
            raise ValueError(f"not an iq: {element.tag}")
        return self._run(self._send_iq(element, timeout), timeout + 1)

    def ping(self, to: str | None = None, timeout: float | None = None) -> ET.Element:
        """XEP-0199 ping (to our server by default); a round trip through the server."""
        iq = ET.Element(f"{{{CLIENT_NS}}}iq", {"type": "get", "to": to or self._server.domain})
        ET.SubElement(iq, f"{{{PING_NS}}}ping")
        return self.send_iq(iq, timeout)

    def execute_command(
        self,
        to_jid: str,
        node: str,
        fields: Mapping[str, str | None],
        timeout: float | None = None,
    ) -> ET.Element:
        """XEP-0050 in one step: ``<command action='execute'>`` carrying a submitted form.

        This is what Conversations does to register with an app server; the fields are
        sent in order, a None value gives a field without ``<value>``. Returns the reply.
        """
        iq = ET.Element(f"{{{CLIENT_NS}}}iq", {"type": "set", "to": to_jid})
        command = ET.SubElement(
            iq, f"{{{COMMANDS_NS}}}command", {"node": node, "action": "execute"}
        )
        command.append(data_form(fields))
        return self.send_iq(iq, timeout)

    def enable_push(
        self,
        component_jid: str,
        node: str,
        secret: str | None = None,
        timeout: float | None = None,
    ) -> ET.Element:
        """XEP-0357 ``<enable>`` on our own account; the secret goes in publish-options."""
        iq = ET.Element(f"{{{CLIENT_NS}}}iq", {"type": "set"})
        enable = ET.SubElement(iq, f"{{{PUSH_NS}}}enable", {"jid": component_jid, "node": node})
        if secret is not None:
            enable.append(data_form({"FORM_TYPE": PUBLISH_OPTIONS_FORM_TYPE, "secret": secret}))
        return self.send_iq(iq, timeout)

    def disable_push(
        self, component_jid: str, node: str | None = None, timeout: float | None = None
    ) -> ET.Element:
        """XEP-0357 ``<disable>`` (one node, or all nodes of the component)."""
        iq = ET.Element(f"{{{CLIENT_NS}}}iq", {"type": "set"})
        attributes = {"jid": component_jid} | ({"node": node} if node is not None else {})
        ET.SubElement(iq, f"{{{PUSH_NS}}}disable", attributes)
        return self.send_iq(iq, timeout)

    def send_message(
        self, to: str, body: str, *, mtype: str = "chat", timeout: float | None = None
    ) -> str:
        """Send a message; returns its id once it is written to the socket.

        While not connected (e.g. after ``abort()``), slixmpp holds the message until the
        next session starts or resumes.
        """
        timeout = self.timeout if timeout is None else timeout
        return self._run(self._send_message(to, body, mtype), timeout)

    def wait_for_message(
        self,
        predicate: Callable[[ET.Element], bool] | None = None,
        timeout: float | None = None,
    ) -> ET.Element:
        """Take the first received, not yet taken message matching ``predicate``.

        By default, the first message with a ``<body>``. Raises TimeoutError.
        """
        timeout = self.timeout if timeout is None else timeout
        match = predicate or (lambda message: message_body(message) is not None)
        deadline = time.monotonic() + timeout
        with self._inbox_changed:
            while True:
                for index, message in enumerate(self._inbox):
                    if match(message):
                        return self._inbox.pop(index)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self._bare_jid}: no matching message in {timeout} s")
                self._inbox_changed.wait(remaining)

    # ----------------------------------------------------------------- loop thread side
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        if self._closed or not self._thread.is_alive():
            coroutine.close()
            raise XmppClientError(f"{self!r} is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self._bare_jid}: no answer in {timeout} s") from None

    @staticmethod
    def _log_loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        log.debug(
            "xmpp test client loop: %s", context.get("message"), exc_info=context.get("exception")
        )

    async def _create(self, resource: str) -> ClientXMPP:
        xmpp = ClientXMPP(
            f"{self._bare_jid}/{resource}",
            self.password,
            plugin_config={
                "feature_mechanisms": {"unencrypted_plain": True, "unencrypted_scram": True}
            },
            loop=asyncio.get_running_loop(),
            # Never used (no TLS on loopback); slixmpp's default context loads the system CA
            # store, which costs about 0.1 s per client.
            ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
        )
        xmpp.enable_direct_tls = False
        xmpp.enable_starttls = True  # only used if offered; our servers offer no TLS
        xmpp.enable_plaintext = True
        xmpp.use_ipv6 = False
        if self.stream_management:
            xmpp.register_plugin("xep_0198")
        xmpp.register_handler(
            Callback("test inbox", MatchXPath(f"{{{CLIENT_NS}}}message"), self._on_message)
        )
        xmpp.add_event_handler("stream_error", self._on_stream_error)
        xmpp.add_event_handler("disconnected", self._on_disconnected)
        return xmpp

    def _on_message(self, stanza: StanzaBase) -> None:
        element = copy.deepcopy(stanza.xml)
        with self._inbox_changed:
            self.received_messages.append(element)
            self._inbox.append(copy.deepcopy(element))
            self._inbox_changed.notify_all()

    def _on_disconnected(self, _reason: object) -> None:
        self._online = False

    def _on_stream_error(self, error: StanzaBase) -> None:
        self.stream_errors.append(copy.deepcopy(error.xml))

    async def _connect(self, timeout: float) -> str:
        xmpp = self._xmpp
        if xmpp.transport is not None:
            raise XmppClientError(f"{self!r} is already connected")
        loop = asyncio.get_running_loop()
        session: asyncio.Future[str] = loop.create_future()
        sm_result: asyncio.Future[bool] = loop.create_future()

        def settle(future: asyncio.Future[Any], value: Any) -> None:
            if not future.done():
                if isinstance(value, BaseException):
                    future.set_exception(value)
                else:
                    future.set_result(value)

        handlers: dict[str, Callable[[Any], None]] = {
            "session_start": lambda _: settle(session, "started"),
            "session_resumed": lambda _: settle(session, "resumed"),
            "failed_all_auth": lambda _: settle(
                session, XmppClientError(f"{self._bare_jid}: authentication failed")
            ),
            "stream_error": lambda error: settle(
                session, XmppClientError(f"{self._bare_jid}: stream error {error['condition']}")
            ),
            "disconnected": lambda reason: settle(
                session, ConnectionError(f"{self._bare_jid}: disconnected ({reason})")
            ),
            "connection_failed": lambda reason: settle(
                session, ConnectionError(f"{self._bare_jid}: cannot connect ({reason})")
            ),
            "sm_enabled": lambda _: settle(sm_result, True),
            "sm_failed": lambda _: settle(sm_result, False),
        }
        for name, handler in handlers.items():
            xmpp.add_event_handler(name, handler)
        try:
            xmpp.connect(self._server.host, self._server.c2s_port)
            try:
                how = await asyncio.wait_for(session, timeout)
                if how == "started":
                    if self.stream_management and not await asyncio.wait_for(sm_result, timeout):
                        raise XmppClientError(f"{self._bare_jid}: stream management refused")
                    xmpp.send_presence()
                # A round trip: the server has processed everything we sent (presence).
                await self._send_iq(self._ping_element(), timeout)
                self._online = True
            except BaseException:
                xmpp.cancel_connection_attempt()
                xmpp.abort()
                raise
            return how
        finally:
            for name, handler in handlers.items():
                xmpp.del_event_handler(name, handler)

    def _ping_element(self) -> ET.Element:
        iq = ET.Element(f"{{{CLIENT_NS}}}iq", {"type": "get", "to": self._server.domain})
        ET.SubElement(iq, f"{{{PING_NS}}}ping")
        return iq

    async def _wait_disconnected(self, action: Callable[[], object], timeout: float) -> None:
        xmpp = self._xmpp
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_disconnected(_: object) -> None:
            if not done.done():
                done.set_result(None)

        xmpp.add_event_handler("disconnected", on_disconnected)
        try:
            action()
            await asyncio.wait_for(done, timeout)
        finally:
            xmpp.del_event_handler("disconnected", on_disconnected)

    async def _disconnect(self, timeout: float) -> None:
        xmpp = self._xmpp
        if xmpp.transport is not None:
            await self._wait_disconnected(lambda: xmpp.disconnect(wait=timeout), timeout + 1)
        # The stream was closed cleanly: the server ended the session, forget it (no resume).
        if self.stream_management:
            xmpp.event("session_end")

    async def _abort(self) -> None:
        xmpp = self._xmpp
        if xmpp.transport is None:
            return
        with contextlib.suppress(TimeoutError):  # let what was sent reach the socket first
            await asyncio.wait_for(xmpp.waiting_queue.join(), 1.0)
        await self._wait_disconnected(xmpp.abort, 5.0)

    async def _shutdown(self) -> None:
        xmpp = self._xmpp
        xmpp.cancel_connection_attempt()
        if xmpp.transport is not None:
            xmpp.abort()
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 2.0)

    async def _send_iq(self, element: ET.Element, timeout: float) -> ET.Element:
        stanza: Iq = self._xmpp.Iq(xml=copy.deepcopy(element))
        try:
            reply = await stanza.send(timeout=timeout)
        except IqError as error:
            reply = error.iq
        except IqTimeout:
            raise TimeoutError(
                f"{self._bare_jid}: no reply to iq {stanza['id']} in {timeout} s"
            ) from None
        return copy.deepcopy(reply.xml)

    async def _send_message(self, to: str, body: str, mtype: str) -> str:
        message = self._xmpp.make_message(mto=to, mbody=body, mtype=mtype)
        message["id"] = self._xmpp.new_id()
        message.send()
        await self._xmpp.waiting_queue.join()
        return str(message["id"])
