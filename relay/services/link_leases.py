"""Leases on component links: which of several gateways holds each XEP-0114 link.

Why the database and not Redis: it is always there (Redis is optional; the embedded default
is SQLite and one host), a lease row sits next to the component it guards (deleted with it,
joined for the admin), and one transaction renews, heartbeats and takes leases together.
The load is a few small statements per gateway every RELAY_GATEWAY_RENEW_SECONDS.

Safety (two gateways never hold one link) rests on two clocks that never meet:

- Expiry is written and compared in the DATABASE's clock (`database_now`), so the hosts'
  clocks may disagree: a gateway takes a lease only once the database says it has expired.
- The holder keeps its own deadline on its MONOTONIC clock, started before it asked for the
  renewal (so before the database stamped it), minus a margin: it drops the link before the
  database can consider the lease expired, even when a renewal is lost or answered late.

Spreading: every gateway heartbeats (`GatewayInstance`) and takes at most its fair share,
ceil(enabled components / live gateways). One over its share (another gateway started) gives
the excess up (the caller drops those links first, then calls `release`): the others take
them at their next round, so a link moves with a gap of about one renewal interval.
"""

from __future__ import annotations

import math
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction
from django.db.models import Q

from relay import features
from relay.models import Component, GatewayInstance, LinkLease

# The holder drops its link this long before the database could let another gateway take it:
# time to abort the link, and slack between the two clocks' rates.
DROP_MARGIN_SECONDS = 2.0
# Heartbeat rows of gateways gone this long are deleted.
FORGET_GATEWAYS_AFTER = timedelta(hours=1)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class LeaseRound:
    """What a gateway holds after one round: the links it runs, and one to give up."""

    held: list[Component]
    shed: list[int]
    live_gateways: int
    share: int


def gateway_name(label: str = "") -> str:
    """A name no other process has: the label (host name by default), pid and a random tag."""
    base = (label or socket.gethostname() or "gateway")[:60]
    return f"{base}/{os.getpid()}/{secrets.token_hex(3)}"


def database_now() -> datetime:
    """The database's clock (PostgreSQL); on SQLite, one host, the local clock is the same."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            value = cursor.fetchone()[0]
        return value.astimezone(UTC)
    return datetime.now(UTC)


def fair_share(links: int, gateways: int) -> int:
    return math.ceil(links / max(1, gateways))


def lease_round(
    *, gateway: str, ttl: float, now: datetime | None = None, channel: str = ""
) -> LeaseRound:
    """Heartbeat, renew what we hold, take free leases up to our fair share: one transaction.

    `now` is for tests; otherwise the database's clock."""
    with transaction.atomic():
        now = now or database_now()
        expires = now + timedelta(seconds=ttl)
        GatewayInstance.objects.update_or_create(
            name=gateway,
            defaults={"expires": expires, "channel": channel},
            create_defaults={"started": now, "expires": expires, "channel": channel},
        )
        GatewayInstance.objects.filter(expires__lt=now - FORGET_GATEWAYS_AFTER).delete()
        live = GatewayInstance.objects.filter(expires__gt=now).count()
        enabled = set(Component.objects.filter(enabled=True).values_list("pk", flat=True))
        _ensure_rows(enabled)
        share = fair_share(len(enabled), live)

        # Ours and not yet expired: renewed (locked, so nobody takes them meanwhile).
        mine = set(
            LinkLease.objects.select_for_update()
            .filter(holder=gateway, expires__gt=now, component_id__in=enabled)
            .values_list("component_id", flat=True)
        )
        if mine:
            LinkLease.objects.filter(component_id__in=mine, holder=gateway).update(expires=expires)

        room = share - len(mine)
        if room > 0:
            free = list(
                LinkLease.objects.select_for_update(skip_locked=True)
                .filter(component_id__in=enabled, expires__lte=now)
                .order_by("component_id")
                .values_list("component_id", flat=True)[:room]
            )
            for component_id in free:
                # Checked again in the statement: on SQLite nothing was locked.
                taken = LinkLease.objects.filter(
                    component_id=component_id, expires__lte=now
                ).update(holder=gateway, expires=expires, acquired=now)
                if taken:
                    mine.add(component_id)
        shed = sorted(mine)[share:]
        # With what the feature apps keep of them (their settings): the gateway's event loop
        # reads them and must not query.
        held = list(
            Component.objects.filter(pk__in=mine)
            .select_related("app", *features.component_related_names())
            .order_by("pk")
        )
    return LeaseRound(held=held, shed=shed, live_gateways=live, share=share)


def _ensure_rows(component_ids: set[int]) -> None:
    missing = component_ids - set(
        LinkLease.objects.filter(component_id__in=component_ids).values_list(
            "component_id", flat=True
        )
    )
    if missing:
        LinkLease.objects.bulk_create(
            [LinkLease(component_id=pk, expires=_EPOCH) for pk in sorted(missing)],
            ignore_conflicts=True,
        )


def release(*, gateway: str, component_ids: list[int]) -> int:
    """Give leases up at once (the caller has dropped their links): others take them next round."""
    if not component_ids:
        return 0
    return LinkLease.objects.filter(component_id__in=component_ids, holder=gateway).update(
        holder="", expires=_EPOCH
    )


def leave(*, gateway: str) -> int:
    """A gateway that stops: every lease released and its heartbeat gone, so the others take
    over at their next round and count one gateway less."""
    with transaction.atomic():
        released = LinkLease.objects.filter(holder=gateway).update(holder="", expires=_EPOCH)
        GatewayInstance.objects.filter(name=gateway).delete()
    return released


def holds(*, gateway: str, component_id: int) -> bool:
    """Whether `gateway` may speak for a component: it holds its lease, or nobody does."""
    now = database_now()
    return not LinkLease.objects.filter(
        ~Q(holder=gateway), component_id=component_id, expires__gt=now
    ).exists()


def channel_of(component_id: int) -> str:
    """Where the gateway holding a component's link takes UnifiedPush messages directly
    ("" when nobody holds it or its holder has no channel). Read by web processes, which
    cache it for a few seconds: a stale answer only makes that gateway decline."""
    row = (
        GatewayInstance.objects.filter(
            name__in=LinkLease.objects.filter(component_id=component_id)
            .exclude(holder="")
            .values("holder"),
            expires__gt=datetime.now(UTC),
        )
        .values_list("channel", flat=True)
        .first()
    )
    return row or ""


def holder_of(lease: LinkLease | None) -> str:
    """The gateway holding a link now ("" if none), for the admin (local clock: display only)."""
    if lease is None or not lease.holder or lease.expires <= datetime.now(UTC):
        return ""
    return lease.holder


@dataclass(frozen=True)
class LiveGateway:
    name: str
    started: datetime
    links: int


def live_gateways() -> list[LiveGateway]:
    """The gateways whose heartbeat is current and how many links each holds (health page)."""
    now = database_now()
    held: dict[str, int] = {}
    for holder in LinkLease.objects.filter(expires__gt=now).values_list("holder", flat=True):
        held[holder] = held.get(holder, 0) + 1
    return [
        LiveGateway(gateway.name, gateway.started, held.get(gateway.name, 0))
        for gateway in GatewayInstance.objects.filter(expires__gt=now).order_by("name")
    ]


def current_holder(component_id: int) -> str:
    return holder_of(LinkLease.objects.filter(component_id=component_id).first())
