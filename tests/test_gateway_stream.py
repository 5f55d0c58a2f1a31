"""The reading side of a component link (xmppgateway/stream.py), byte for byte.

The adapter around slixmpp's parser runs here on a real socket pair in this process: the test
is the XMPP server's end, so it can check exactly which bytes close a stream, that a stanza is
refused within one slice past the byte limit, what goes to slixmpp and what to us, and that
the per-connection task slixmpp starts is ended. (The same behaviour through the real gateway
process: tests/test_gateway_stanzas.py.)
"""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.support.waiting import async_wait_until
from xmppgateway.stream import FEED_SLICE, GuardedStream, StreamLimits, stream_error

pytestmark = pytest.mark.defaults

HEADER = (
    b"<?xml version='1.0'?><stream:stream xmlns:stream='http://etherx.jabber.org/streams' "
    b"xmlns='jabber:component:accept' from='push.localhost' id='s1'>"
)
LIMITS = StreamLimits(max_stanza_bytes=8192, max_depth=6)


class Recorder(GuardedStream):
    def __init__(self, limits: StreamLimits = LIMITS) -> None:
        super().__init__("push.localhost", "secret", "127.0.0.1", 1, limits=limits)
        self.requests: list[ET.Element] = []
        self.session_started = asyncio.Event()
        self.add_event_handler("session_start", lambda _: self.session_started.set())

    def on_request(self, iq: ET.Element) -> None:
        self.requests.append(iq)


class Peer:
    """The server's end of the socket pair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received = bytearray()

    async def send(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def read_until_closed(self, timeout: float = 5.0) -> bytes:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while chunk := await loop.sock_recv(self.sock, 65536):
                self.received += chunk
        return bytes(self.received)


def run(test: Callable[[Recorder, Peer], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        stream = Recorder(**kwargs)
        await asyncio.get_running_loop().create_connection(lambda: stream, sock=ours)
        try:
            await test(stream, Peer(theirs))
        finally:
            if stream.transport is not None:
                stream.transport.abort()
            theirs.close()

    asyncio.run(main())


async def settle() -> None:
    """Twenty turns of the loop: what the peer wrote is read and answered (one thread: it
    takes turns, not time, so a busy machine only makes it slower)."""
    for _ in range(20):
        await asyncio.sleep(0.005)


def iq(iq_type: str, iq_id: str, payload: str = "<query xmlns='x'/>") -> bytes:
    return f"<iq type='{iq_type}' from='localhost' id='{iq_id}'>{payload}</iq>".encode()


def test_get_and_set_iqs_come_to_us_the_handshake_goes_to_slixmpp_the_rest_nowhere():
    async def test(stream: Recorder, peer: Peer) -> None:
        await peer.send(HEADER + b"<handshake/>")
        await asyncio.wait_for(stream.session_started.wait(), 5)
        # One byte at a time: the slicing must not matter.
        data = (
            iq("get", "g1")
            + iq("set", "s1")
            + b"<message from='a@localhost'><body>hi</body></message>"
            + b"<presence from='a@localhost'/>"
            + iq("result", "r1", "")
            + iq("set", "s2")
        )
        for byte in data:
            await peer.send(bytes([byte]))
        await async_wait_until(lambda: len(stream.requests) >= 3, what="three requests")
        assert [request.get("id") for request in stream.requests] == ["g1", "s1", "s2"]
        assert stream.requests[0][0].tag == "{x}query"  # payloads stay whole
        assert len(stream.xml_root) == 0  # the root keeps no stanza

    run(test)


def test_a_stanza_at_the_limits_passes():
    async def test(stream: Recorder, peer: Peer) -> None:
        await peer.send(HEADER + iq("get", "first"))  # the count starts after a stanza
        nested = "<a>" * 4 + "</a>" * 4  # iq, q and four a: six levels
        padding = "p" * (8192 - 100 - len(nested))
        await peer.send(iq("set", "edge", f"<q xmlns='x'>{padding}{nested}</q>"))
        await async_wait_until(lambda: len(stream.requests) >= 2, what="two requests")
        assert [request.get("id") for request in stream.requests] == ["first", "edge"]
        assert stream.transport is not None and not stream.closed_with

    run(test)


def test_a_stanza_past_the_byte_limit_is_refused_within_one_slice():
    async def test(stream: Recorder, peer: Peer) -> None:
        await peer.send(HEADER)
        sent = len(HEADER)
        await peer.send(b"<iq type='set' id='big'><q xmlns='x'>")
        while not stream.closed_with:
            await peer.send(b"y" * 1024)
            sent += 1024
            await settle()
            assert sent < 8192 + 2 * FEED_SLICE + len(HEADER), "read past the limit"
        closing = await peer.read_until_closed()
        assert closing.endswith(
            b"<stream:error><policy-violation xmlns='urn:ietf:params:xml:ns:xmpp-streams'/>"
            b"<text xmlns='urn:ietf:params:xml:ns:xmpp-streams'>a stanza is larger than "
            b"8192 bytes</text></stream:error></stream:stream>"
        )
        assert b"yyy" not in closing
        assert stream.requests == []

    run(test)


def test_a_stanza_past_the_depth_limit_is_refused():
    async def test(stream: Recorder, peer: Peer) -> None:
        await peer.send(HEADER + b"<iq type='set' id='deep'>" + b"<a>" * 6)
        closing = await peer.read_until_closed()
        assert stream.closed_with == "policy-violation"
        assert b"nests deeper than 6" in closing

    run(test)


def test_bad_xml_ends_the_stream_with_a_well_formed_error_that_echoes_nothing():
    async def test(stream: Recorder, peer: Peer) -> None:
        await peer.send(HEADER + iq("set", "ok") + b"<iq type='set' id='secret-x'><a></b></iq>")
        closing = await peer.read_until_closed()
        assert stream.closed_with == "not-well-formed"
        assert closing.endswith(stream_error("not-well-formed"))
        assert b"secret-x" not in closing
        # What we sent parses (the stream header slixmpp wrote, then the error and its end).
        ET.fromstring(closing.replace(b"<stream:stream ", b"<stream:stream xmlns:x='y' ", 1))
        assert [request.get("id") for request in stream.requests] == ["ok"]  # before the error

    run(test)


def test_a_dtd_before_the_stream_header_is_restricted_xml():
    async def test(stream: Recorder, peer: Peer) -> None:
        await peer.send(b"<?xml version='1.0'?><!DOCTYPE stream:stream [<!ENTITY a 'b'>]>")
        closing = await peer.read_until_closed()
        assert stream.closed_with == "restricted-xml"
        assert b"<restricted-xml xmlns='urn:ietf:params:xml:ns:xmpp-streams'/>" in closing

    run(test)


def test_a_peer_that_does_not_read_is_not_read_either():
    async def test(stream: Recorder, peer: Peer) -> None:
        await peer.send(HEADER)
        assert stream.transport is not None
        # Our answers pile up unread beyond the transport's high-water mark...
        stream.transport.write(b" " * (1024 * 1024))
        assert stream.transport.get_write_buffer_size() > 0
        assert not stream.transport.is_reading()
        # ...until the peer reads them.
        loop = asyncio.get_running_loop()
        drained = 0
        while drained < 1024 * 1024:
            drained += len(await loop.sock_recv(peer.sock, 1024 * 1024))
        await async_wait_until(stream.transport.is_reading, what="reading again")

    run(test)


def test_release_ends_the_output_task_slixmpp_starts_per_connection():
    """Left pending on a dropped object, it was logged as "Task was destroyed but it is
    pending!" at every reconnect while a link was down."""

    async def main() -> None:
        stream = Recorder()
        stream.connect("127.0.0.1", 1)  # refused; the output task is started regardless
        task = stream._run_out_filters
        assert task is not None and not task.done()
        await stream.release()
        assert task.done()

    asyncio.run(main())


# --- the link on top of it (xmppgateway/component.py), still on a socket pair


def push_component() -> Any:
    from relay.models import Component
    from xmppgateway.component import PushComponent

    async def no_blocking_calls(*args: object, **kwargs: object) -> object:
        raise AssertionError("no service call expected")

    component = Component(pk=1, jid="push.localhost", secret="s", host="127.0.0.1", port=1)
    return PushComponent(component, run_blocking=no_blocking_calls, max_field_length=4096)


def answers(data: bytes) -> dict[str, ET.Element]:
    root = ET.fromstring(b"<r xmlns='jabber:component:accept'>" + data.split(b">", 1)[1] + b"</r>")
    return {element.get("id", ""): element for element in root}


def test_a_handler_that_raises_is_answered_wait_and_the_link_stays(monkeypatch):
    from xmppgateway import handlers

    def broken(ctx: object, request: object) -> handlers.Answer:
        raise RuntimeError("a bug")

    monkeypatch.setitem(handlers.HANDLERS, ("get", "{urn:test}broken"), broken)

    async def main() -> None:
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        stream = push_component()
        await asyncio.get_running_loop().create_connection(lambda: stream, sock=ours)
        peer = Peer(theirs)
        await peer.send(HEADER)
        await peer.send(
            b"<iq type='get' from='localhost' id='b1'><broken xmlns='urn:test'/></iq>"
            b"<iq type='get' from='a&amp;&quot;b@localhost' id='q&quot;1'>"
            b"<query xmlns='http://jabber.org/protocol/disco#info'/></iq>"
        )
        await settle()
        stream.transport.close()
        got = answers(await peer.read_until_closed())
        error = got["b1"].find("{jabber:component:accept}error")
        assert error is not None and error.get("type") == "wait"
        # An odd but valid sender is answered, its address escaped back as it came.
        assert got['q"1'].get("to") == 'a&"b@localhost'
        # '"' is not allowed in a localpart
        assert got['q"1'].find(".//{urn:ietf:params:xml:ns:xmpp-stanzas}jid-malformed") is not None
        theirs.close()

    asyncio.run(main())


def test_streams_share_one_tls_context_and_keep_none_of_their_own():
    """slixmpp builds a TLS context with the system's CA certificates for every stream (0.83
    MB each); a component link never uses TLS, so every stream shares one empty context and
    the one slixmpp built is freed. Fails if slixmpp keeps its context elsewhere than
    `ssl_context`, where `get_ssl_context` reads it."""

    def live_contexts() -> int:
        gc.collect()
        return sum(isinstance(thing, ssl.SSLContext) for thing in gc.get_objects())

    async def main() -> None:  # the streams take the running loop, closed by asyncio.run
        first = Recorder()
        before = live_contexts()
        streams = [Recorder() for _ in range(5)]
        assert live_contexts() == before
        shared = first.get_ssl_context()
        assert all(stream.get_ssl_context() is shared for stream in streams)
        assert shared.cert_store_stats()["x509_ca"] == 0  # no CA certificates loaded

    asyncio.run(main())
