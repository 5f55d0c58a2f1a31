"""The links a gateway takes at once are built one per turn of its event loop.

Building a link's stream holds the loop (most of it slixmpp's TLS context). Built all in one
turn, hundreds of links held it past the leases' deadline: the lease rounds could not run,
the gateway dropped every link for its lost leases and started them all again, and none
stayed up (bench/links.py --links 0,500; docs/benchmarks.md). The real gateway's links
run here in this process against a port nobody listens on; a task that counts the loop's
turns is read at each build.
"""

from __future__ import annotations

import asyncio

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings

from relay.models import Component
from tests.support.ports import free_port
from tests.support.waiting import async_wait_until
from xmppgateway.gateway import Gateway, Link

pytestmark = [pytest.mark.defaults, pytest.mark.django_db(transaction=True)]

LINKS = 5


def test_links_started_together_are_built_one_per_turn_of_the_loop(component, monkeypatch):
    closed_port = free_port()
    components = [component] + [
        Component.objects.create(
            tenant=component.tenant,
            app=component.app,
            jid=f"push{n}.localhost",
            secret="s3cr3t",
            host="127.0.0.1",
            port=closed_port,
        )
        for n in range(1, LINKS)
    ]
    turns = 0
    built_at: list[int] = []
    build = Link._build

    def counted_build(link: Link, *args: object) -> object:
        built_at.append(turns)
        return build(link, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Link, "_build", counted_build)

    async def main() -> None:
        nonlocal turns
        gateway = Gateway()
        links = [Link(gateway, each) for each in components]
        stop = asyncio.Event()

        async def count_turns() -> None:
            nonlocal turns
            while not stop.is_set():
                turns += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count_turns())
        try:
            for link in links:
                link.start()
            await async_wait_until(lambda: len(built_at) >= LINKS, what="every link built")
        finally:
            stop.set()
            await counter
            for link in links:
                await link.stop(grace=0)
            # The one database thread's connection, closed as the real process's end would.
            await asyncio.get_running_loop().run_in_executor(
                gateway.executor, connections.close_all
            )
            gateway.executor.shutdown(wait=True)
            gateway.lease_executor.shutdown(wait=True)

    with override_settings(RELAY={**settings.RELAY, "GATEWAY_THREADS": 1}):
        asyncio.run(main())
    # The loop turned between any two builds: whatever else was ready ran in between.
    assert len(set(built_at[:LINKS])) == LINKS, built_at
