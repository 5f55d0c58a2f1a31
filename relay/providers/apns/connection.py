"""How a request reaches APNs through aioapns: the one module that uses aioapns' undocumented
parts (aioapns 4.0, pinned in pyproject.toml).

aioapns documents the `APNs` client (its constructor and `send_notification`),
`NotificationRequest` and `PushType`; `relay.providers.apns` uses only those. What has no
documented way is here, each for a reason:

- The host. `APNs` has no host argument: its connection pool dials
  `pool.protocol_class.APNS_SERVER:APNS_PORT` (and sends APNS_SERVER as the `host` header), a
  class chosen by `use_sandbox`. `point_at` gives the pool a subclass of
  `APNsTLSClientProtocol` with the app's host and port, so Apple's hosts and a local fake are
  one code path.
- That subclass fixes hangs and leaks of the protocol in 4.0: a request written to a closing
  connection waits for ever; flow-control credit is never returned, so about 64 KiB of error
  bodies stall a connection for good; a 200's stream entry is never removed and an error
  without a body never resolves; connections idle out after 10 s where Apple asks to keep them
  open; every new connection signs a new JWT, and Apple refuses more than one per 20 minutes
  (429 TooManyProviderTokenUpdates). It reads and writes the protocol's `transport`, `conn`,
  `requests`, `request_streams`, `request_statuses` and the JWT provider's `key`, `key_id`,
  `team_id`.
- Closing. `pool.close()` only starts each connection's TLS goodbye; `close` waits on the
  pool's `connections` until each is lost (a loop ending first would leak their sockets).
- Sending. Not `APNs.send_notification`: its pool sleeps 1 s after every failed connect before
  it retries, and a send that outlives its timeout cannot be aborted through it; the relay's
  queue does the retrying. `send` takes a connection with `pool.acquire()` and sends on it.

tests/test_apns_connection.py checks, against the installed aioapns, that each of these names
exists and is what aioapns uses: an upgrade that changes one fails there.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from aioapns import APNs, NotificationRequest
from aioapns.common import NotificationResult
from aioapns.connection import (
    APNsTLSClientProtocol,
    AuthorizationHeaderProvider,
    JWTAuthorizationHeaderProvider,
)
from aioapns.exceptions import ConnectionClosed
from h2.exceptions import NoAvailableStreamIDError

__all__ = ["NotificationResult", "close", "point_at", "send"]

# One JWT signer per key in this process (used on the loop thread only).
_jwt_providers: dict[tuple[str, str, str], JWTAuthorizationHeaderProvider] = {}


class _EndpointProtocol(APNsTLSClientProtocol):
    """aioapns' protocol with its leaks and hangs fixed; subclassed per endpoint."""

    # Apple asks to keep connections open rather than reconnect per burst (aioapns: 10 s).
    INACTIVITY_TIME = 60
    lost = False

    def __init__(
        self,
        apns_topic: str,
        loop: asyncio.AbstractEventLoop | None = None,
        on_connection_lost: Any = None,
        auth_provider: AuthorizationHeaderProvider | None = None,
    ) -> None:
        if isinstance(auth_provider, JWTAuthorizationHeaderProvider):
            key = (auth_provider.key, auth_provider.key_id, auth_provider.team_id)
            auth_provider = _jwt_providers.setdefault(key, auth_provider)
        super().__init__(apns_topic, loop, on_connection_lost, auth_provider)

    @property
    def closing(self) -> bool:
        return self.lost or self.transport is None or self.transport.is_closing()

    @property
    def is_busy(self) -> bool:
        # A closing connection stays in aioapns' pool until connection_lost: skip it.
        return self.closing or super().is_busy

    def abort(self) -> None:
        """Drop a connection that stopped answering, without waiting for a TLS goodbye."""
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        super().connection_lost(exc)

    async def send_notification(self, request: NotificationRequest) -> NotificationResult:
        if self.closing:
            raise ConnectionClosed("connection is closing")
        return await super().send_notification(request)

    def on_data_received(self, raw_data: bytes, stream_id: int) -> None:
        self.conn.acknowledge_received_data(len(raw_data), stream_id)
        super().on_data_received(raw_data, stream_id)

    def on_stream_ended(self, stream_id: int) -> None:
        notification_id = self.request_streams.pop(stream_id, None)
        if notification_id is not None:
            status = self.request_statuses.pop(notification_id, None)
            future = self.requests.pop(notification_id, None) if status else None
            if future is not None and not future.done():
                future.set_result(NotificationResult(notification_id, status or ""))
        super().on_stream_ended(stream_id)


@functools.lru_cache(maxsize=64)
def _protocol_for(host: str, port: int) -> type[_EndpointProtocol]:
    return type(
        "ApnsEndpointProtocol", (_EndpointProtocol,), {"APNS_SERVER": host, "APNS_PORT": port}
    )


def point_at(client: APNs, host: str, port: int) -> None:
    """Make `client` connect to host:port, through the fixed protocol."""
    client.pool.protocol_class = _protocol_for(host, port)


async def close(client: APNs, timeout: float = 2.0) -> None:
    """Close the client's connections, on its loop, and wait until each has let go of its
    socket (TLS says goodbye first, over several turns of the loop, which may end right after);
    one still open after `timeout` is aborted."""
    connections = [c for c in client.pool.connections if isinstance(c, _EndpointProtocol)]
    client.pool.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(not c.lost for c in connections) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    for connection in connections:
        if not connection.lost:
            connection.abort()
    await asyncio.sleep(0)


async def send(client: APNs, request: NotificationRequest, timeout: float) -> NotificationResult:
    """Send once, plus once more on a new connection if the connection dropped under it.

    Raises TimeoutError when no answer came within `timeout` seconds (the connection is
    aborted: a silent one is usually dead), ConnectionClosed when it dropped twice, and
    whatever connecting raised (aioapns' ConnectionError, ssl errors).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for _attempt in range(2):
        connection = await asyncio.wait_for(
            client.pool.acquire(), max(deadline - loop.time(), 0.001)
        )
        # Never cancel aioapns' send: it would later set a result on the cancelled future and
        # kill the connection with every other request on it.
        task = asyncio.ensure_future(connection.send_notification(request))
        done, _ = await asyncio.wait({task}, timeout=max(deadline - loop.time(), 0))
        if not done:
            task.add_done_callback(_swallow)
            if isinstance(connection, _EndpointProtocol):
                connection.abort()
            else:
                connection.close()
            raise TimeoutError
        try:
            return task.result()
        except (ConnectionClosed, NoAvailableStreamIDError):
            connection.close()
    raise ConnectionClosed("the connection dropped twice")


def _swallow(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned task's exception so asyncio does not log it."""
    if not task.cancelled():
        task.exception()
