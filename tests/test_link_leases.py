"""Leases on component links (relay/services/link_leases.py): one holder per link, fair
shares across live gateways, takeover after expiry, and at once after a release.

Rounds are given explicit times where expiry is the point, so nothing sleeps; the race test
runs real gateways' rounds in threads, each on its own database connection (PostgreSQL).
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from relay.models import (
    App,
    Component,
    ComponentLink,
    GatewayInstance,
    LinkLease,
    LinkState,
    Tenant,
)
from relay.services import link_leases, links

TTL = 10.0


def make_components(count: int, *, enabled: bool = True) -> list[Component]:
    tenant, _ = Tenant.objects.get_or_create(name="leases")
    app, _ = App.objects.get_or_create(tenant=tenant, name="app")
    start = Component.objects.count()
    return [
        Component.objects.create(
            tenant=tenant,
            app=app,
            jid=f"push{start + i}.localhost",
            secret="s3cr3t-s3cr3t",
            host="127.0.0.1",
            port=5347,
            enabled=enabled,
        )
        for i in range(count)
    ]


def held_ids(lease_round: link_leases.LeaseRound) -> set[int]:
    return {component.pk for component in lease_round.held}


def holders() -> dict[int, str]:
    return dict(LinkLease.objects.values_list("component_id", "holder"))


@pytest.mark.defaults
@pytest.mark.django_db
class TestOneDatabase:
    def test_a_lone_gateway_holds_every_enabled_link(self):
        enabled = make_components(3)
        make_components(1, enabled=False)
        now = datetime.now(UTC)
        first = link_leases.lease_round(gateway="a", ttl=TTL, now=now)
        assert held_ids(first) == {c.pk for c in enabled}
        assert (first.live_gateways, first.share, first.shed) == (1, 3, [])
        # Renewed, not taken again: the same set, the lease pushed forward.
        again = link_leases.lease_round(gateway="a", ttl=TTL, now=now + timedelta(seconds=3))
        assert held_ids(again) == held_ids(first)
        lease = LinkLease.objects.get(component=enabled[0])
        assert lease.expires == now + timedelta(seconds=3 + TTL)

    def test_a_second_gateway_gets_its_share_from_the_first(self):
        components = make_components(3)
        now = datetime.now(UTC)
        a = link_leases.lease_round(gateway="a", ttl=TTL, now=now)
        assert len(a.held) == 3  # alone so far
        b = link_leases.lease_round(gateway="b", ttl=TTL, now=now)
        assert (b.held, b.live_gateways, b.share) == ([], 2, 2)  # nothing free yet
        a = link_leases.lease_round(gateway="a", ttl=TTL, now=now + timedelta(seconds=1))
        assert len(a.held) == 3 and len(a.shed) == 1  # one over its share: give one up
        # The gateway drops that link, then releases its lease; b takes it at its next round.
        assert link_leases.release(gateway="a", component_ids=a.shed) == 1
        b = link_leases.lease_round(gateway="b", ttl=TTL, now=now + timedelta(seconds=2))
        assert held_ids(b) == set(a.shed)
        a = link_leases.lease_round(gateway="a", ttl=TTL, now=now + timedelta(seconds=3))
        assert held_ids(a) == {c.pk for c in components} - set(b.shed) - held_ids(b)
        assert a.shed == [] and len(a.held) == 2

    def test_a_lease_not_renewed_is_taken_only_after_it_expired(self):
        components = make_components(2)
        now = datetime.now(UTC)
        link_leases.lease_round(gateway="a", ttl=TTL, now=now)
        # a dies. Before its lease and heartbeat expire, b counts two gateways and takes none.
        early = link_leases.lease_round(gateway="b", ttl=TTL, now=now + timedelta(seconds=TTL - 1))
        assert early.held == [] and early.live_gateways == 2
        late = link_leases.lease_round(gateway="b", ttl=TTL, now=now + timedelta(seconds=TTL + 1))
        assert held_ids(late) == {c.pk for c in components}
        assert late.live_gateways == 1
        # a comes back from a long pause: its leases are gone, it holds nothing it had.
        back = link_leases.lease_round(gateway="a", ttl=TTL, now=now + timedelta(seconds=TTL + 2))
        assert back.held == [] and back.share == 1
        assert set(holders().values()) == {"b"}

    def test_a_gateway_that_leaves_hands_over_at_once(self):
        components = make_components(2)
        now = datetime.now(UTC)
        link_leases.lease_round(gateway="a", ttl=TTL, now=now)
        link_leases.lease_round(gateway="b", ttl=TTL, now=now)
        assert link_leases.leave(gateway="a") == 2
        assert not GatewayInstance.objects.filter(name="a").exists()
        b = link_leases.lease_round(gateway="b", ttl=TTL, now=now + timedelta(seconds=1))
        assert held_ids(b) == {c.pk for c in components}

    def test_a_disabled_component_is_no_longer_held(self):
        [component] = make_components(1)
        now = datetime.now(UTC)
        assert len(link_leases.lease_round(gateway="a", ttl=TTL, now=now).held) == 1
        Component.objects.filter(pk=component.pk).update(enabled=False)
        assert link_leases.lease_round(gateway="a", ttl=TTL, now=now).held == []

    def test_a_gateway_that_lost_a_lease_cannot_overwrite_the_link_state(self):
        [component] = make_components(1)
        now = datetime.now(UTC) - timedelta(seconds=TTL + 5)  # a's lease expired by now
        link_leases.lease_round(gateway="a", ttl=TTL, now=now)
        link_leases.lease_round(gateway="b", ttl=TTL)  # the real clock: b takes it over
        assert link_leases.current_holder(component.pk) == "b"
        assert link_leases.holds(gateway="b", component_id=component.pk)
        assert not link_leases.holds(gateway="a", component_id=component.pk)
        links.record_link_state(component_id=component.pk, state=LinkState.UP, gateway="b")
        # a's late "down" (its link dropped when its lease ran out) must not hide b's link.
        links.record_link_state(component_id=component.pk, state=LinkState.DOWN, gateway="a")
        assert ComponentLink.objects.get(component=component).state == LinkState.UP

    def test_names_differ_per_process_start(self):
        first, second = link_leases.gateway_name("gw"), link_leases.gateway_name("gw")
        assert first != second and first.startswith("gw/")
        assert len(link_leases.gateway_name("x" * 300)) <= 100


@pytest.mark.django_db(transaction=True)
def test_gateways_racing_never_share_a_link():
    """Eight gateways' rounds at once, again and again: never a link with two holders; once
    settled each gateway holds at most its share, and between them they hold every link."""
    assert connection.vendor == "postgresql", "the race needs PostgreSQL's row locks"
    components = make_components(11)
    gateways = [f"gw{i}" for i in range(8)]
    errors: list[BaseException] = []
    rounds: dict[str, link_leases.LeaseRound] = {}

    def run(name: str, barrier: threading.Barrier) -> None:
        try:
            barrier.wait()
            rounds[name] = link_leases.lease_round(gateway=name, ttl=600.0)
        except BaseException as error:  # reported below
            errors.append(error)
        finally:
            connection.close()

    # Rounds until every link is held (each round may shed what the next one takes); on a
    # busy machine a round can take seconds, so the leases here outlive any number of them.
    for _ in range(30):
        barrier = threading.Barrier(len(gateways))
        threads = [threading.Thread(target=run, args=(name, barrier)) for name in gateways]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        claimed = [c for r in rounds.values() for c in held_ids(r)]
        assert len(claimed) == len(set(claimed)), "a link held by two gateways"
        for name, result in rounds.items():  # as the gateway does it: drop, then release
            link_leases.release(gateway=name, component_ids=result.shed)
        settled = all(
            r.share == link_leases.fair_share(11, 8) and len(r.held) <= r.share and not r.shed
            for r in rounds.values()
        )
        if settled and set(claimed) == {c.pk for c in components}:
            break
    assert set(claimed) == {c.pk for c in components}
    share = link_leases.fair_share(11, 8)
    assert all(r.share == share and len(r.held) <= share and not r.shed for r in rounds.values())
    assert set(holders().values()) <= set(gateways)
