"""The gateway's end of the direct path (relay/unifiedpush/services/channel.py): a TCP
listener that web processes hand UnifiedPush messages to, answered when the phone did.

A plain asyncio protocol, no streams and no task per message: it is on the hot path of every
relay, and a verdict is written back from the future's callback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from relay.unifiedpush.services import channel
from relay.unifiedpush.services.store import NewMessage

log = logging.getLogger(__name__)

Verdict = tuple[str, int | None]
Offer = Callable[[NewMessage], "asyncio.Future[Verdict]"]


class _Connection(asyncio.Protocol):
    def __init__(self, offer: Offer, connections: set[_Connection]) -> None:
        self._offer = offer
        self._connections = connections
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self.pending: set[asyncio.Future[Verdict]] = set()

    def connection_made(self, transport: Any) -> None:
        self._transport = transport  # asyncio turns Nagle off on TCP transports itself
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        # Offers already sent still end stored or delivered: their futures run on.
        self._transport = None
        self._connections.discard(self)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        while True:
            end = buffer.find(b"\n")
            if end < 0:
                break
            line, buffer = buffer[: end + 1], buffer[end + 1 :]
            if not self._request(line):
                return
        if len(buffer) > channel.MAX_LINE:
            self._refuse("line too long")
            return
        self._buffer = buffer

    def _request(self, line: bytes) -> bool:
        try:
            number, message = channel.parse_request(line)
        except channel.BadRequest:
            self._refuse("malformed")
            return False
        verdict = self._offer(message)
        if verdict.done():
            self._answer(number, verdict)
        else:
            self.pending.add(verdict)
            verdict.add_done_callback(lambda done: self._answer(number, done))
        return True

    def _answer(self, number: int, verdict: asyncio.Future[Verdict]) -> None:
        self.pending.discard(verdict)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(channel.encode_answer(number, *verdict.result()))

    def _refuse(self, reason: str) -> None:
        log.warning("unifiedpush.channel_refused", extra={"reason": reason})
        self._buffer = b""
        if self._transport is not None:
            self._transport.close()


class ChannelServer:
    def __init__(self, bind: tuple[str, int], offer: Offer) -> None:
        self._bind = bind
        self._offer = offer
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self.address = ""

    async def start(self) -> str:
        """Listen; the address web processes reach us at (announced with our leases)."""
        host, port = self._bind
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self._offer, self._connections), host, port, reuse_address=True
        )
        bound = self._server.sockets[0].getsockname()
        announced = host
        if host in ("0.0.0.0", "::", ""):
            announced = socket.getfqdn()
        if ":" in announced:
            announced = f"[{announced}]"
        self.address = f"{announced}:{bound[1]}"
        log.info("unifiedpush.channel_listening", extra={"port": bound[1]})
        return self.address

    async def stop(self) -> None:
        """Called once the relay stored or finished every offer: their answers are written,
        then the connections close."""
        if self._server is not None:
            self._server.close()
        pending = [f for conn in self._connections for f in conn.pending]
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        await asyncio.sleep(0)  # let the last answers' callbacks write
        for conn in list(self._connections):
            if conn._transport is not None:
                conn._transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
