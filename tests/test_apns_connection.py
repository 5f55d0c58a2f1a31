"""aioapns' undocumented names that relay/providers/apns/connection.py relies on, checked against
the installed aioapns with its own classes (not ours) and the HTTP/2 fake of Apple.

Each test fails when aioapns stops using a name the way the adapter assumes: then the adapter
needs a look before the upgrade. No database, no Django.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aioapns import APNs, NotificationRequest, PushType
from aioapns.common import NotificationResult
from aioapns.connection import APNsTLSClientProtocol, JWTAuthorizationHeaderProvider
from aioapns.exceptions import ConnectionClosed

from relay.providers.apns import connection as apns_connection
from tests.fakes.apns import FakeApns
from tests.support.provider_fakes import APNS_TOPIC, start_apns
from tests.support.waiting import async_wait_until

TOPIC = APNS_TOPIC


@pytest.fixture(scope="module")
def apns() -> Iterator[tuple[FakeApns, str]]:
    fake, key_pem = start_apns()
    yield fake, key_pem
    fake.stop()


@pytest.fixture
def fake(apns) -> FakeApns:
    apns[0].reset()
    return apns[0]


@pytest.fixture
def key_pem(apns) -> str:
    return apns[1]


def new_client(fake: FakeApns, key_pem: str) -> APNs:
    """A client through the documented constructor (call inside the loop it will run on)."""
    context = ssl.create_default_context(cafile=fake.ca_file)
    context.set_alpn_protocols(["h2"])
    return APNs(
        key=key_pem, key_id=fake.key_id, team_id=fake.team_id, topic=TOPIC, ssl_context=context
    )


def protocol(fake: FakeApns, base: type[APNsTLSClientProtocol] = APNsTLSClientProtocol, **attrs):
    return type("Probe", (base,), {"APNS_SERVER": fake.host, "APNS_PORT": fake.port, **attrs})


def request(token: str) -> NotificationRequest:
    return NotificationRequest(
        device_token=token,
        message={"aps": {"content-available": 1}},
        notification_id=str(uuid.uuid4()),
        push_type=PushType.BACKGROUND,
    )


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    await async_wait_until(condition, timeout)


def test_the_pool_dials_its_protocol_class_and_sends_its_host(fake, key_pem):
    """`point_at`: the pool connects to protocol_class.APNS_SERVER:APNS_PORT, sends APNS_SERVER
    as the host header, and `pool.close()` closes what `pool.acquire()` opened."""
    token = secrets.token_hex(32)

    async def scenario() -> tuple[NotificationResult, bool]:
        client = new_client(fake, key_pem)
        client.pool.protocol_class = protocol(fake)
        connection = await client.pool.acquire()
        result = await client.send_notification(request(token))
        client.pool.close()
        await until(lambda: fake.open_connections == 0)
        return result, isinstance(connection, client.pool.protocol_class)

    result, dialled_ours = asyncio.run(scenario())

    assert result.is_successful and dialled_ours
    (seen,) = fake.requests
    assert seen.token == token
    assert seen.headers["host"] == fake.host


def test_the_protocol_hooks_and_state_the_adapter_uses(fake, key_pem):
    """The constructor's arguments, the hooks `_EndpointProtocol` overrides and the state it
    reads are the ones aioapns calls and fills; the leak and the error answer it fixes are
    still there."""
    calls: list[tuple[Any, ...]] = []

    class Recording(APNsTLSClientProtocol):
        def __init__(self, apns_topic, loop=None, on_connection_lost=None, auth_provider=None):
            calls.append(("init", apns_topic, loop, on_connection_lost, auth_provider))
            super().__init__(apns_topic, loop, on_connection_lost, auth_provider)

        @property
        def is_busy(self) -> bool:
            calls.append(("is_busy",))
            return super().is_busy

        async def send_notification(self, request: NotificationRequest) -> NotificationResult:
            calls.append(("send", request.notification_id))
            return await super().send_notification(request)

        def on_data_received(self, raw_data: bytes, stream_id: int) -> None:
            state = (dict(self.request_streams), dict(self.request_statuses), set(self.requests))
            calls.append(("data", stream_id, *state))
            self.conn.acknowledge_received_data(len(raw_data), stream_id)
            super().on_data_received(raw_data, stream_id)

        def on_stream_ended(self, stream_id: int) -> None:
            calls.append(("ended", stream_id, dict(self.request_streams)))
            super().on_stream_ended(stream_id)

        def connection_lost(self, exc: Exception | None) -> None:
            calls.append(("lost",))
            super().connection_lost(exc)

    delivered, dead = request(secrets.token_hex(32)), request(secrets.token_hex(32))
    fake.respond(dead.device_token, status=410, reason="Unregistered")

    async def scenario() -> tuple[Any, ...]:
        client = new_client(fake, key_pem)
        client.pool.protocol_class = protocol(fake, Recording)
        connection = await client.pool.acquire()
        again = await client.pool.acquire()
        transport = connection.transport
        answers = [await connection.send_notification(r) for r in (delivered, dead)]
        left = dict(connection.request_streams)
        client.pool.close()
        await until(lambda: ("lost",) in calls)
        return connection, again, transport, answers, left

    connection, again, transport, answers, left = asyncio.run(scenario())

    (init,) = [c for c in calls if c[0] == "init"]
    assert init[1] == TOPIC and init[3] is not None
    provider = init[4]
    assert isinstance(provider, JWTAuthorizationHeaderProvider)
    assert (provider.key, provider.key_id, provider.team_id) == (key_pem, fake.key_id, fake.team_id)
    assert again is connection and ("is_busy",) in calls
    assert isinstance(transport, asyncio.Transport)
    assert ("send", delivered.notification_id) in calls
    assert [(a.status, a.description) for a in answers] == [("200", None), ("410", "Unregistered")]
    # An error answer: its status is kept by apns-id until the body arrives on its stream.
    (data,) = [c for c in calls if c[0] == "data"]
    assert data[2][data[1]] == dead.notification_id
    assert data[3] == {dead.notification_id: "410"}
    assert data[4] == {dead.notification_id}
    # A 200's stream entry is never removed by aioapns (the leak `on_stream_ended` plugs).
    ended = [c for c in calls if c[0] == "ended"]
    assert len(ended) == 2
    assert delivered.notification_id in ended[0][2].values()
    assert list(left.values()) == [delivered.notification_id]
    # The result type the adapter builds for an error without a body.
    bare = NotificationResult(dead.notification_id, "400")
    assert (bare.status, bare.description) == ("400", None)


def test_inactivity_time_is_what_closes_an_idle_connection(fake, key_pem):
    """`_EndpointProtocol.INACTIVITY_TIME` (60 s instead of 10 s) is the name aioapns reads."""

    async def scenario() -> None:
        client = new_client(fake, key_pem)
        client.pool.protocol_class = protocol(fake, INACTIVITY_TIME=0.1)
        await client.send_notification(request(secrets.token_hex(32)))
        await until(lambda: fake.open_connections == 0)

    asyncio.run(scenario())

    assert len(fake.requests) == 1


def test_a_connection_dropped_under_a_request_raises_connection_closed(fake, key_pem):
    """`send` retries once on ConnectionClosed: what aioapns raises when the line drops."""
    token = secrets.token_hex(32)
    fake.respond(token, close_connection=True)

    async def scenario() -> BaseException | None:
        client = new_client(fake, key_pem)
        client.pool.protocol_class = protocol(fake)
        connection = await client.pool.acquire()
        try:
            await asyncio.wait_for(connection.send_notification(request(token)), 5)
        except Exception as error:
            return error
        finally:
            client.pool.close()
        return None

    assert isinstance(asyncio.run(scenario()), ConnectionClosed)


def test_the_adapter_sends_through_the_fixed_protocol(fake, key_pem):
    """`apns_connection.point_at`, `send` and `close` together, as the provider uses them:
    closing finds the connection in the pool's `connections` and returns once it is lost."""
    token = secrets.token_hex(32)
    pooled: list[Any] = []

    async def scenario() -> NotificationResult:
        client = new_client(fake, key_pem)
        apns_connection.point_at(client, fake.host, fake.port)
        try:
            return await apns_connection.send(client, request(token), 5.0)
        finally:
            pooled.extend(client.pool.connections)
            await apns_connection.close(client)

    assert asyncio.run(scenario()).is_successful
    assert [r.token for r in fake.requests] == [token]
    assert len(pooled) == 1 and pooled[0].lost
