"""The reading side of a component link: the ONE module that reaches into slixmpp internals.

Why: slixmpp parses a stream in `XMLStream.data_received`, and there it (a) has no limit on a
stanza's size or nesting depth, (b) answers a parse error with `<stream:stream:error>` (its
serializer maps the stream prefix twice) carrying up to a whole read of what it received, and
(c) turns every stanza into a stanza object and a task before any handler may refuse it. None
of that can be changed through its public API, so `GuardedStream` replaces `data_received`
with a loop over the same `XMLPullParser` that:

- feeds the parser in small slices and closes the stream with `policy-violation` as soon as a
  stanza grows beyond `max_stanza_bytes` or nests deeper than `max_depth`, so a 10 MB stanza
  costs one slice over the limit, never 10 MB of buffering;
- refuses a DTD before the stream header (`restricted-xml`: entities could expand small input
  into huge text behind the byte limit's back);
- closes with a well-formed `<stream:error>` that never repeats input;
- hands every iq of type get/set straight to `on_request` (the gateway answers those itself,
  synchronously where it can), and only what slixmpp must see (the handshake, stream errors,
  iq results and errors) to slixmpp's own handling (`_spawn_event`), except the answers
  `on_answer` takes (the phones' answers to UnifiedPush pushes, sent as raw XML) and presence,
  which goes to `on_presence` (a phone announcing it is back). Messages are dropped: the relay
  offers nothing for them.

It also stops writing when the peer stops reading (`pause_writing` pauses reading, so a peer
that never reads our answers cannot grow our write buffer), and `release()` ends the output
task slixmpp starts per connection (`_run_out_filters`), which it otherwise leaves pending on a
dropped object: the "Task was destroyed but it is pending!" errors while a link was down.

Attributes of `XMLStream` used here: `parser`, `xml_depth`, `xml_root`, `transport`,
`disconnect_reason`, `_run_out_filters`, `init_parser()`, `start_stream_handler()`,
`_spawn_event()`, `abort()`. Tested by tests/test_gateway_stream.py (limits, stream errors,
routing) and tests/test_gateway_stanzas.py (through the real gateway process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast
from xml.sax.saxutils import escape

from slixmpp import ComponentXMPP

log = logging.getLogger(__name__)

STREAM_NS = "http://etherx.jabber.org/streams"
STREAMS_NS = "urn:ietf:params:xml:ns:xmpp-streams"
ACCEPT_NS = "jabber:component:accept"
CLIENT_NS = "jabber:client"
# The parser is fed at most this many bytes at a time: the byte limit is enforced to within
# one slice, and the depth limit within the events of one slice.
FEED_SLICE = 4096
# After closing, a peer that does not read gets this long to take the stream error.
CLOSE_GRACE_SECONDS = 5.0

_IQ_TAGS = frozenset({f"{{{ACCEPT_NS}}}iq", f"{{{CLIENT_NS}}}iq"})
_PRESENCE_TAGS = frozenset({f"{{{ACCEPT_NS}}}presence", f"{{{CLIENT_NS}}}presence"})
_FOR_SLIXMPP = frozenset({f"{{{ACCEPT_NS}}}handshake", f"{{{STREAM_NS}}}error"})


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """What one top-level stanza may be: its size in bytes (the bytes read since the previous
    stanza ended, whitespace keepalives included) and its depth (the stanza itself is 1)."""

    max_stanza_bytes: int = 262_144
    max_depth: int = 32


def stream_error(condition: str, text: str = "") -> bytes:
    """A well-formed stream error and the end of our stream (RFC 6120 4.9)."""
    body = f"<{condition} xmlns='{STREAMS_NS}'/>"
    if text:
        body += f"<text xmlns='{STREAMS_NS}'>{escape(text)}</text>"
    return f"<stream:error>{body}</stream:error></stream:stream>".encode()


# slixmpp's XMLStream builds a TLS context with the system's CA certificates for every
# stream, most of a link's memory (docs/benchmarks.md, Capacity); a component link is plain
# TCP and never uses it. Every link shares this one instead, and its own is freed as the
# stream is made.
_UNUSED_TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class GuardedStream(ComponentXMPP):
    """A slixmpp component whose incoming side is bounded and whose get/set iqs are ours."""

    def __init__(self, *args: object, limits: StreamLimits, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.ssl_context = _UNUSED_TLS
        self.limits = limits
        self.closed_with = ""  # the stream error condition we closed with, if we did
        self._unread = 0
        self._prelude = b""
        self._closing = False

    # --- what subclasses implement

    def on_request(self, iq: ET.Element) -> None:
        """A get/set iq arrived (its element stays valid after this returns; keep only what
        is needed of it: a waiting request holding its stanza holds up to max_stanza_bytes)."""
        raise NotImplementedError

    def on_answer(self, iq: ET.Element) -> bool:
        """A result or error iq: True when it answered a request sent outside slixmpp."""
        return False

    def on_presence(self, presence: ET.Element) -> None:
        """Presence routed to the component; dropped unless a subclass wants it."""

    # --- reading

    _quickack: Any = None

    def connection_made(self, transport: Any, send_event: bool = True) -> None:
        super().connection_made(transport, send_event)
        sock = transport.get_extra_info("socket")
        self._quickack = sock if sock is not None and hasattr(socket, "TCP_QUICKACK") else None

    def _ack_now(self) -> None:
        """Acknowledge what the server sent at once instead of with our next write. XMPP
        servers write with Nagle's algorithm on (Prosody's default), so each of their writes
        waits for our acknowledgement of the previous one: left to the kernel's delayed
        acknowledgement, the phones' answers would come back late under steady traffic.
        Linux resets the flag after every acknowledgement."""
        with contextlib.suppress(OSError):
            self._quickack.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def init_parser(self) -> None:
        super().init_parser()
        self._unread = 0
        self._prelude = b""
        self._closing = False
        self.closed_with = ""

    def data_received(self, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode()
        if self._quickack is not None:
            self._ack_now()
        for start in range(0, len(data), FEED_SLICE):
            if self._closing or self.parser is None:
                return
            self._feed(data[start : start + FEED_SLICE])

    def _feed(self, piece: bytes) -> None:
        parser = self.parser
        assert parser is not None
        if self.xml_depth == 0:
            self._prelude += piece
            if b"<!" in self._prelude.split(b"<stream", 1)[0]:
                self.close_stream("restricted-xml", "no DTD or comment before the stream header")
                return
        self._unread += len(piece)
        # The hot loop of the gateway: one pass per parser event, kept free of calls.
        max_depth = self.limits.max_depth + 1  # the stream's root is depth 1
        depth = self.xml_depth
        try:
            parser.feed(piece)
            for event, element in cast(Iterator[tuple[str, ET.Element]], parser.read_events()):
                if event == "start":
                    if depth == 0:
                        self._open_stream(element)
                    depth += 1
                    if depth > max_depth:
                        self.xml_depth = depth
                        self.close_stream(
                            "policy-violation",
                            f"a stanza nests deeper than {self.limits.max_depth}",
                        )
                        return
                    continue
                depth -= 1
                if depth == 1:
                    self.xml_depth = depth
                    self._stanza(element)
                    if self._closing:
                        return
                elif depth == 0:
                    self.xml_depth = depth
                    self.disconnect_reason = "End of stream"
                    self.abort()
                    return
        except ET.ParseError:
            self.close_stream("not-well-formed")
            return
        finally:
            self.xml_depth = depth
        if self._unread > self.limits.max_stanza_bytes:
            self.close_stream(
                "policy-violation", f"a stanza is larger than {self.limits.max_stanza_bytes} bytes"
            )

    def _open_stream(self, root: ET.Element) -> None:
        self.xml_root = root
        self._prelude = b""
        self.start_stream_handler(root)

    def _stanza(self, element: ET.Element) -> None:
        """A top-level stanza ended."""
        self._unread = 0
        if self.xml_root is not None:
            self.xml_root.clear()  # keep the root empty of the stanzas it has seen
        tag = element.tag
        if tag in _IQ_TAGS:
            if element.get("type") in ("get", "set"):
                self.on_request(element)
            elif not self.on_answer(element):
                self._spawn_event(element)  # results and errors of our own requests
        elif tag in _PRESENCE_TAGS:
            self.on_presence(element)
        elif tag in _FOR_SLIXMPP:
            self._spawn_event(element)

    # --- closing

    def close_stream(self, condition: str, text: str = "") -> None:
        """End the stream with a stream error; nothing more is read."""
        if self._closing:
            return
        self._closing = True
        self.closed_with = condition
        self.disconnect_reason = condition
        self.parser = None
        transport = self.transport
        if transport is None:
            return
        transport.write(stream_error(condition, text))
        transport.close()  # once the error is written
        # A peer that never reads would keep the socket open forever: cut it.
        asyncio.get_running_loop().call_later(CLOSE_GRACE_SECONDS, transport.abort)

    async def release(self) -> None:
        """End what slixmpp started for this object; call once its connection is over."""
        self.cancel_connection_attempt()
        task = self._run_out_filters
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- flow control: a peer that does not read our answers stops being read

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self._closing:
            self.transport.resume_reading()
