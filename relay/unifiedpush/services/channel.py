"""The hop from a web process to the gateway that holds a component's link: the direct path.

A POST for a phone that is online needs no store: the web process hands the sealed message
to the gateway, which sends the `<push>` iq at once and answers when the phone did. Only when
the phone did not take it within `RELAY_UNIFIEDPUSH_DIRECT_SECONDS` (offline, hibernated,
slow, an error) does the gateway store it, exactly as the web process would have, and then
the POST is answered. Either way a `201` is only ever sent for a message that was delivered
or stored, and the gateway refuses the direct path whenever it could reorder a phone's
messages (it has stored ones, or might) or does not hold the link: then the web process
stores the message itself.

Wire format, one line each way over a TCP connection the web process keeps: one per gateway
on its event loop (`AsyncChannels`), one per gateway and thread for a caller without a loop
(`hand_over`):

    request:  <n> <tenant> <component> <endpoint key> <recipient key> <topic key or -> <urgency>
              <received µs> <expires µs> <endpoint expires µs> <size> <ttl> <sealed, base64>
    answer:   <n> D            delivered (the phone answered result)
              <n> X            TTL 0 and not taken at once: ended as expired, never stored
              <n> S <id>       stored as message <id> (the phone did not take it yet)
              <n> R            revoked (the phone refused the endpoint): 404
              <n> N            not here: store it yourself
              <n> E            the gateway could not store it: store it yourself

The JID, application, instance and body travel only inside the sealed part (AES-256-GCM
under UNIFIEDPUSH_KEYS), so the gateway sends nothing it could not open and authenticate.
The listener is on loopback unless RELAY_UNIFIEDPUSH_CHANNEL says otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from relay.unifiedpush.services.store import NewMessage

log = logging.getLogger(__name__)

DELIVERED, EXPIRED, STORED, REVOKED, NOT_HERE, FAILED = "D", "X", "S", "R", "N", "E"
MAX_LINE = 16 * 1024  # a 4096-byte body sealed and in base64, with room to spare
CONNECT_SECONDS = 0.5
# How much longer than the gateway's window the web process waits for an answer before it
# gives up on the hop (the gateway may be stuck) and stores the message itself.
ANSWER_SLACK_SECONDS = 5.0


class BadRequest(ValueError):
    pass


def _us(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000)


def _moment(value: str) -> datetime:
    return datetime.fromtimestamp(int(value) / 1_000_000, UTC)


def parse_bind(value: str) -> tuple[str, int] | None:
    """host:port, or None for "off" / empty; ValueError for anything else."""
    value = value.strip()
    if value.lower() in ("", "off"):
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError("expected host:port")
    return host.strip("[]"), int(port)


def encode_request(number: int, message: NewMessage) -> bytes:
    return (
        f"{number} {message.tenant_id} {message.component_id} {message.endpoint_key} "
        f"{message.recipient_key} {message.topic_key or '-'} {message.urgency} "
        f"{_us(message.received)} {_us(message.expires)} {_us(message.endpoint_expires)} "
        f"{message.size} {message.ttl} {base64.b64encode(message.sealed).decode()}\n"
    ).encode()


def parse_request(line: bytes) -> tuple[int, NewMessage]:
    """The request number and the message; BadRequest for anything else."""
    parts = line.split()
    if len(parts) != 13:
        raise BadRequest("wrong number of fields")
    try:
        texts = [part.decode("ascii") for part in parts]
        message = NewMessage(
            tenant_id=int(texts[1]),
            component_id=int(texts[2]),
            endpoint_key=texts[3],
            recipient_key=texts[4],
            topic_key="" if texts[5] == "-" else texts[5],
            urgency=int(texts[6]),
            received=_moment(texts[7]),
            expires=_moment(texts[8]),
            endpoint_expires=_moment(texts[9]),
            size=int(texts[10]),
            ttl=int(texts[11]),
            sealed=base64.b64decode(parts[12], validate=True),
        )
        return int(texts[0]), message
    except (ValueError, OverflowError, OSError, UnicodeDecodeError, binascii.Error) as error:
        raise BadRequest(str(error)) from None


def encode_answer(number: int, verdict: str, message_id: int | None = None) -> bytes:
    if message_id is None:
        return f"{number} {verdict}\n".encode()
    return f"{number} {verdict} {message_id}\n".encode()


@dataclass(frozen=True, slots=True)
class Handover:
    verdict: str
    message_id: int | None = None


class _Connection:
    def __init__(self, address: str, timeout: float) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(timeout)
        self.reader = self.sock.makefile("rb")
        self.number = 0

    def close(self) -> None:
        for closable in (self.reader, self.sock):
            with contextlib.suppress(OSError):
                closable.close()


_local = threading.local()


def hand_over(address: str, message: NewMessage, *, window: float) -> Handover | None:
    """Offer a message to the gateway at `address`: its verdict, or None when the hop failed
    (the caller stores the message; the phone may then get it twice, never zero times)."""
    connections: dict[str, _Connection] = _local.__dict__.setdefault("connections", {})
    for attempt in (1, 2):  # a kept connection the gateway closed meanwhile: one fresh try
        conn = connections.get(address)
        fresh = conn is None
        try:
            if conn is None:
                conn = connections[address] = _Connection(
                    address, timeout=window + ANSWER_SLACK_SECONDS
                )
            conn.number += 1
            conn.sock.sendall(encode_request(conn.number, message))
            line = conn.reader.readline(MAX_LINE)
            if not line:
                raise ConnectionResetError("closed by the gateway")
            fields = line.split()
            if len(fields) < 2 or int(fields[0]) != conn.number:
                raise ConnectionError("answer out of step")
            verdict = fields[1].decode("ascii")
            if verdict == STORED:
                return Handover(STORED, int(fields[2]))
            if verdict in (DELIVERED, EXPIRED, REVOKED, NOT_HERE, FAILED):
                return Handover(verdict)
            raise ConnectionError("unknown answer")
        except (OSError, ValueError, IndexError) as error:
            if conn is not None:
                conn.close()
            connections.pop(address, None)
            if isinstance(error, TimeoutError) or fresh or attempt == 2:
                # A timeout means the gateway may be sending it: a second offer would only
                # duplicate; the store is the safe way on.
                log.warning(
                    "unifiedpush.channel_failed", extra={"error_type": type(error).__name__}
                )
                return None
    return None


def forget_connections() -> None:
    """Close this thread's kept connections (tests, and a worker that stops)."""
    connections: dict[str, _Connection] = _local.__dict__.pop("connections", {})
    for conn in connections.values():
        conn.close()


class _AsyncClient(asyncio.Protocol):
    """One connection to one gateway, shared by every POST of an event loop: offers are
    numbered, written together once per turn of the loop, and matched to their answers."""

    def __init__(self, on_lost: Callable[[_AsyncClient], None], timeout: float) -> None:
        self._on_lost = on_lost
        self._timeout = timeout
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._outgoing: list[bytes] = []
        self._number = 0
        self.pending: dict[int, tuple[asyncio.Future[Handover | None], asyncio.TimerHandle]] = {}

    def connection_made(self, transport: Any) -> None:
        self._transport = transport  # asyncio turns Nagle off on TCP transports itself

    def offer(self, message: NewMessage) -> asyncio.Future[Handover | None]:
        loop = asyncio.get_running_loop()
        verdict: asyncio.Future[Handover | None] = loop.create_future()
        if self._transport is None or self._transport.is_closing():
            verdict.set_result(None)
            return verdict
        self._number += 1
        number = self._number
        self.pending[number] = (verdict, loop.call_later(self._timeout, self._give_up))
        if not self._outgoing:
            loop.call_soon(self._flush)
        self._outgoing.append(encode_request(number, message))
        return verdict

    def _flush(self) -> None:
        if self._outgoing and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(self._outgoing))
        self._outgoing.clear()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        lines = buffer.split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            fields = line.split()
            try:
                entry = self.pending.pop(int(fields[0]))
                verdict = fields[1].decode("ascii")
                handover = (
                    Handover(STORED, int(fields[2])) if verdict == STORED else Handover(verdict)
                )
            except (ValueError, IndexError, KeyError):
                log.warning("unifiedpush.channel_failed", extra={"error_type": "BadAnswer"})
                self._give_up()
                return
            entry[1].cancel()
            if not entry[0].done():
                entry[0].set_result(handover)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _give_up(self) -> None:
        """An answer overdue or garbled: the gateway may be stuck. Every offer waiting here
        is stored by its web process (the phone may get one twice, never none)."""
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        pending, self.pending = self.pending, {}
        for verdict, timer in pending.values():
            timer.cancel()
            if not verdict.done():
                verdict.set_result(None)
        self._on_lost(self)


class AsyncChannels:
    """The direct path for a web process that runs an event loop (pushsite/server.py):
    one connection per gateway, shared by all its POSTs."""

    def __init__(self, *, window: float) -> None:
        self._timeout = window + ANSWER_SLACK_SECONDS
        self._clients: dict[str, _AsyncClient] = {}
        self._connecting: dict[str, asyncio.Future[_AsyncClient | None]] = {}

    async def offer(self, address: str, message: NewMessage) -> Handover | None:
        """The gateway's verdict, or None when the hop failed (the caller stores it)."""
        client = self._clients.get(address)
        if client is None:
            client = await self._connect(address)
            if client is None:
                return None
        return await client.offer(message)

    async def _connect(self, address: str) -> _AsyncClient | None:
        connecting = self._connecting.get(address)
        if connecting is not None:
            return await asyncio.shield(connecting)
        loop = asyncio.get_running_loop()
        connecting = self._connecting[address] = loop.create_future()
        client: _AsyncClient | None = None
        try:
            host, _, port = address.rpartition(":")
            _, connected = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _AsyncClient(self._lost, self._timeout), host.strip("[]"), int(port)
                ),
                CONNECT_SECONDS,
            )
            client = self._clients[address] = connected
        except (OSError, ValueError, TimeoutError) as error:
            log.warning("unifiedpush.channel_failed", extra={"error_type": type(error).__name__})
        finally:
            del self._connecting[address]
            connecting.set_result(client)
        return client

    async def aclose(self) -> None:
        """Closes the connections, on the loop they were made on (a caller whose loop ends)."""
        clients, self._clients = self._clients, {}
        for client in clients.values():
            client.close()
        await asyncio.sleep(0)  # a closed transport lets go of its socket on the next turn

    def _lost(self, client: _AsyncClient) -> None:
        for address, known in list(self._clients.items()):
            if known is client:
                del self._clients[address]
