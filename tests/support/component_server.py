"""The XMPP-server end of an XEP-0114 link, driven by a test.

Real servers only publish well-formed stanzas from their own domain; to see how the gateway
answers hostile or odd stanzas from a server (missing node, full-JID senders, huge fields,
unexpected iq types) a test plays the server itself: it accepts the gateway's component
connection, checks the handshake, sends raw stanzas and reads the answers.
"""

from __future__ import annotations

import hashlib
import secrets
import socket
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Protocol


class Gateway(Protocol):
    """What a wait needs of the gateway's process (tests/support/processes.py)."""

    def alive(self) -> bool: ...

    def log_tail(self) -> str: ...


STREAM_NS = "http://etherx.jabber.org/streams"
ACCEPT_NS = "jabber:component:accept"
STANZAS_NS = "urn:ietf:params:xml:ns:xmpp-stanzas"
STREAMS_NS = "urn:ietf:params:xml:ns:xmpp-streams"


class FakeXmppServer:
    """Accepts component connections on 127.0.0.1 and records every stanza they send.

    Per connection it also keeps the raw bytes received (`received`, to check what the
    gateway wrote byte for byte), the stream errors it got (`stream_errors`: condition names),
    and whether the gateway's stream stopped being well-formed (`not_well_formed`).
    `header_prefix` is written between the XML declaration and our stream header (e.g. a DTD,
    as a hostile server could send).
    """

    def __init__(self, component_jid: str, secret: str, *, header_prefix: bytes = b"") -> None:
        self.component_jid = component_jid
        self.secret = secret
        self.header_prefix = header_prefix
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self.stanzas: list[ET.Element] = []
        self.connections = 0
        self.accepted = 0
        self.handshakes_refused = 0
        self.received: list[bytearray] = []
        self.stream_errors: list[str] = []
        self.not_well_formed = 0
        self.closed_connections = 0
        self._conn: socket.socket | None = None
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    # --- serving

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        parser = ET.XMLPullParser(("start", "end"))
        stream_id = secrets.token_hex(8)
        depth = 0
        received = bytearray()
        with self._cond:
            self.accepted += 1
            self.received.append(received)
        try:
            while data := conn.recv(65536):
                received += data
                parser.feed(data)
                for event, element in parser.read_events():
                    if event == "start":
                        depth += 1
                        if depth == 1:
                            conn.sendall(
                                b"<?xml version='1.0'?>"
                                + self.header_prefix
                                + (
                                    f"<stream:stream "
                                    f"xmlns:stream='{STREAM_NS}' xmlns='{ACCEPT_NS}' "
                                    f"from='{self.component_jid}' id='{stream_id}'>"
                                ).encode()
                            )
                        continue
                    depth -= 1
                    if depth != 1:
                        continue
                    if element.tag == f"{{{ACCEPT_NS}}}handshake":
                        expected = hashlib.sha1((stream_id + self.secret).encode()).hexdigest()
                        if (element.text or "").strip() != expected:
                            conn.sendall(
                                b"<stream:error><not-authorized "
                                b"xmlns='urn:ietf:params:xml:ns:xmpp-streams'/></stream:error>"
                                b"</stream:stream>"
                            )
                            with self._cond:
                                self.handshakes_refused += 1
                                self._cond.notify_all()
                            return
                        conn.sendall(b"<handshake/>")
                        with self._cond:
                            self._conn = conn
                            self.connections += 1
                            self._cond.notify_all()
                    elif element.tag == f"{{{STREAM_NS}}}error":
                        conditions = [
                            child.tag.split("}", 1)[1]
                            for child in element
                            if child.tag.startswith(f"{{{STREAMS_NS}}}")
                            and not child.tag.endswith("}text")
                        ]
                        with self._cond:
                            self.stream_errors.append(conditions[0] if conditions else "")
                            self._cond.notify_all()
                    else:
                        with self._cond:
                            self.stanzas.append(element)
                            self._cond.notify_all()
        except ET.ParseError:
            with self._cond:
                self.not_well_formed += 1
        except OSError:
            pass  # the connection ends; the gateway is expected to reconnect
        finally:
            with self._cond:
                if self._conn is conn:
                    self._conn = None
                self.closed_connections += 1
                self._cond.notify_all()
            conn.close()

    # --- driving

    def wait_connected(
        self, timeout: float = 60.0, *, count: int = 1, gateway: Gateway | None = None
    ) -> None:
        """Until the gateway's `count`-th link is up. Given the `gateway` process, a gateway
        that died or never came says why (its log's tail) instead of only timing out."""
        deadline = time.monotonic() + timeout

        def connected() -> bool:
            return self._conn is not None and self.connections >= count

        with self._cond:
            while not self._cond.wait_for(connected, min(0.5, timeout)):
                if gateway is not None and not gateway.alive():
                    raise RuntimeError(f"the gateway died\n{gateway.log_tail()}")
                if time.monotonic() > deadline:
                    seen = (
                        f"{self.accepted} connections accepted, {self.connections} handshakes, "
                        f"{self.handshakes_refused} refused, stream errors {self.stream_errors}"
                    )
                    tail = f"\n{gateway.log_tail()}" if gateway is not None else ""
                    raise TimeoutError(
                        f"the gateway did not connect ({count} wanted) in {timeout} s: {seen}{tail}"
                    )

    def send(self, xml: str | bytes) -> None:
        with self._cond:
            conn = self._conn
        if conn is None:
            raise ConnectionError("no component connected")
        conn.sendall(xml if isinstance(xml, bytes) else xml.encode())

    def wait_stream_error(self, condition: str, timeout: float = 30.0) -> None:
        """Until the gateway sent a stream error with `condition`."""
        with self._cond:
            if not self._cond.wait_for(lambda: condition in self.stream_errors, timeout):
                raise TimeoutError(
                    f"no stream error {condition!r} (got {self.stream_errors}, "
                    f"{self.not_well_formed} not well-formed)"
                )

    def reply_to(self, iq_id: str, timeout: float = 30.0) -> ET.Element:
        def find() -> ET.Element | None:
            for stanza in self.stanzas:
                if stanza.get("id") == iq_id:
                    return stanza
            return None

        with self._cond:
            if not self._cond.wait_for(lambda: find() is not None, timeout):
                raise TimeoutError(f"no answer to iq {iq_id!r}")
            found = find()
        assert found is not None
        return found

    def wait_for(
        self, predicate: Callable[[ET.Element], bool], timeout: float = 30.0, *, count: int = 1
    ) -> list[ET.Element]:
        """The first `count` stanzas (ever received) that match, once there are that many."""

        def found() -> list[ET.Element]:
            return [stanza for stanza in self.stanzas if predicate(stanza)][:count]

        with self._cond:
            if not self._cond.wait_for(lambda: len(found()) >= count, timeout):
                raise TimeoutError(f"fewer than {count} matching stanzas in {timeout} s")
            return found()

    def request(self, xml: str, iq_id: str, timeout: float = 30.0) -> ET.Element:
        self.send(xml)
        return self.reply_to(iq_id, timeout)

    def drop_connection(self) -> None:
        with self._cond:
            conn = self._conn
        if conn is not None:
            conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self.drop_connection()
        self._listener.close()


def error_of(stanza: ET.Element) -> tuple[str, str] | None:
    """(type, condition) of an error reply, or None for a result."""
    if stanza.get("type") != "error":
        return None
    error = next((child for child in stanza if child.tag.endswith("}error")), None)
    if error is None:
        return ("", "")
    conditions = [
        child.tag.split("}", 1)[1]
        for child in error
        if child.tag.startswith(f"{{{STANZAS_NS}}}") and not child.tag.endswith("}text")
    ]
    return (error.get("type", ""), conditions[0] if conditions else "")
