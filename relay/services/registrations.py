"""Registering and unregistering devices (the p2 ad-hoc commands, and later the HTTP API).

New registrations are bounded, so that a hostile account or server cannot fill the database:
a token bucket per account domain (within the tenant) and one per tenant, and a cap on the
registrations a domain and a tenant may keep (RELAY REGISTRATION_*). Beyond either the phone
is answered `wait` (it tries again later), never `cancel`: a cap is an operator's limit, not
the phone's fault. A device that registers again (a new token, the same device and room) is
never refused. Registrations that no publish ever reached are removed after a while
(`remove_unused_registrations`), so what a flood left behind does not stay.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import cast

from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from relay import conf, features, metrics
from relay.conf import CountPerSeconds
from relay.identifiers import account_hash, new_node, new_secret
from relay.models import Component, DeadLetter, Delivery, Registration, Service, Tenant
from relay.services import channels, lifecycle, throttling

log = logging.getLogger(__name__)

# How long a counted number of registrations is trusted before counting again (per process).
# A cap may so be passed by what other processes create meanwhile: at most the rate limit's
# worth of this many seconds.
CAP_COUNT_SECONDS = 60.0
MAX_COUNTS_KEPT = 10_000


class UnknownRegistration(Exception):
    """Nothing to unregister."""


class RegistrationRefused(Exception):
    """A new registration over a rate limit or a cap; answered `wait` with `text`."""

    def __init__(self, text: str, retry_after: float = 0.0) -> None:
        super().__init__(text)
        self.text = text
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class RegistrationAnswer:
    """What the phone needs to enable push on its server."""

    component_jid: str
    node: str
    secret: str


def _domain_of(bare_jid: str) -> str:
    return bare_jid.rsplit("@", 1)[-1]


def register_device(
    *,
    component: Component,
    service: Service,
    bare_jid: str,
    device_id: str,
    token: str,
    room_jid: str = "",
) -> RegistrationAnswer:
    """Create a registration, or update the token of the existing one.

    The same device (and room) keeps its node and secret: the phone may re-register whenever
    its token changes, and the user's server must keep publishing to the same node. Only a new
    registration passes the limits (`RegistrationRefused`).
    """
    # An address the app can never send to is refused now, not dead-lettered at each push.
    channels.check_sendable(app_id=cast(int, component.app_id), service=service, token=token)
    device_hash = account_hash(bare_jid, device_id)
    room_hash = account_hash(room_jid, device_id) if room_jid else ""
    domain = _domain_of(bare_jid)
    key = {
        "app_id": component.app_id,
        "service": service,
        "device_hash": device_hash,
        "room_hash": room_hash,
    }
    admitted = False
    for _ in range(3):
        registration = Registration.objects.filter(**key).first()
        if registration is not None:
            Registration.objects.filter(pk=registration.pk).update(
                token=token,
                component=component,
                account_domain=domain,
                dead_since=None,
                updated=timezone.now(),
            )
            lifecycle.renewed(registration, token=token)
            metrics.REGISTRATIONS.labels(str(component.tenant_id), "renewed").inc()
            return RegistrationAnswer(component.jid, registration.node, registration.secret)
        if not admitted:
            tenant = Tenant.objects.only("pk", "created").get(pk=component.tenant_id)
            try:
                admit_new_registration(tenant=tenant, domain=domain)
            except RegistrationRefused:
                metrics.REGISTRATIONS.labels(str(tenant.pk), "refused").inc()
                raise
            admitted = True
        try:
            with transaction.atomic():
                registration = Registration.objects.create(
                    **key,
                    component=component,
                    account_domain=domain,
                    token=token,
                    node=new_node(),
                    secret=new_secret(),
                )
                lifecycle.created([registration])
            _counted(tenant.pk, domain)
            metrics.REGISTRATIONS.labels(str(tenant.pk), "created").inc()
            return RegistrationAnswer(component.jid, registration.node, registration.secret)
        except IntegrityError:
            # A concurrent registration of the same device won, or (astronomically rarely)
            # the node collided: look again.
            continue
    raise RuntimeError("registration kept conflicting")


def unregister_device(
    *, component: Component, service: Service, bare_jid: str, device_id: str, room_jid: str = ""
) -> None:
    device_hash = account_hash(bare_jid, device_id)
    room_hash = account_hash(room_jid, device_id) if room_jid else ""
    deleted, _ = lifecycle.delete_logged(
        Registration.objects.filter(
            app_id=cast(int, component.app_id),
            service=service,
            device_hash=device_hash,
            room_hash=room_hash,
        )
    )
    if not deleted:
        raise UnknownRegistration
    metrics.REGISTRATIONS.labels(str(component.tenant_id), "unregistered").inc()


# --- limits on new registrations -----------------------------------------------------------


def _bucket(rate: CountPerSeconds, key: str) -> throttling.Bucket:
    count, seconds = rate
    if count <= 0 or seconds <= 0:
        return throttling.Bucket(key, throttling.Limit(rate=0, burst=1))
    return throttling.Bucket(key, throttling.Limit(rate=count / seconds, burst=int(count)))


def admit_new_registration(*, tenant: Tenant, domain: str) -> None:
    """Raise `RegistrationRefused` when a new registration of an account of `domain` would
    pass the tenant's or the domain's rate limit or cap."""
    # The tenant's creation time keeps a re-created tenant with a reused id off old buckets.
    config = conf.current()
    tenant_key = f"rg:t:{tenant.pk}:{int(tenant.created.timestamp())}"
    refusal = throttling.take_tokens(
        [
            _bucket(config.registration_rate_per_domain, f"{tenant_key}:{domain}"),
            _bucket(config.registration_rate_per_tenant, tenant_key),
        ]
    )
    if refusal is not None:
        whose = "from this domain" if refusal.bucket == 0 else "for this push service"
        log.warning(
            "registration.rate_limited",
            extra={
                "tenant": tenant.pk,
                "limit": "domain" if refusal.bucket == 0 else "tenant",
                "retry_in": round(refusal.retry_after, 1),
            },
        )
        raise RegistrationRefused(
            f"too many new registrations {whose}; try again in "
            f"{max(1, round(refusal.retry_after))} s",
            refusal.retry_after,
        )
    caps = (
        (config.registration_cap_per_domain, domain, "domain", " for one domain"),
        (config.registration_cap_per_tenant, None, "tenant", ""),
    )
    for cap, counted_domain, limit, scope in caps:
        if cap > 0 and _count(tenant.pk, counted_domain) >= cap:
            log.warning("registration.cap_reached", extra={"tenant": tenant.pk, "limit": limit})
            raise RegistrationRefused(
                f"this push service keeps at most {cap} registrations{scope}; "
                "ask its operator to raise the limit"
            )


_counts_lock = threading.Lock()
_counts: dict[tuple[int, str | None], tuple[int, float]] = {}


def _count(tenant_id: int, domain: str | None) -> int:
    """Registrations of the tenant (of one account domain of it), counted at most every
    CAP_COUNT_SECONDS: counting a large tenant is not free."""
    key = (tenant_id, domain)
    now = time.monotonic()
    with _counts_lock:
        cached = _counts.get(key)
    if cached is not None and cached[1] > now:
        return cached[0]
    rows = Registration.objects.filter(app__tenant_id=tenant_id)
    if domain is not None:
        rows = rows.filter(account_domain=domain)
    count = rows.count()
    with _counts_lock:
        if len(_counts) >= MAX_COUNTS_KEPT:  # many domains: keep what is still fresh
            for stale in [k for k, (_, until) in _counts.items() if until <= now]:
                del _counts[stale]
            if len(_counts) >= MAX_COUNTS_KEPT:
                _counts.clear()
        _counts[key] = (count, now + CAP_COUNT_SECONDS)
    return count


def _counted(tenant_id: int, domain: str) -> None:
    """A registration was created here: the cached counts move with it."""
    with _counts_lock:
        for key in ((tenant_id, domain), (tenant_id, None)):
            cached = _counts.get(key)
            if cached is not None:
                _counts[key] = (cached[0] + 1, cached[1])


def forget_counts() -> None:
    """Count again at the next registration (tests, or after a bulk change)."""
    with _counts_lock:
        _counts.clear()


# --- clean-up --------------------------------------------------------------------------------


def remove_unused_registrations(
    *, older_than_days: float | None = None, now: datetime | None = None
) -> int:
    """Delete registrations that no publish ever reached within that many days of their last
    registration: no successful push, no delivery record, no dead letter. What a flood of
    register commands left behind goes; a phone that is still there registers again (and gets a
    new node). Registrations a feature app removes by its own rule are left to it
    (relay.features: `kept_registrations`; the Windows devices' accounts, for one).
    0 or less disables the removal.
    """
    days = older_than_days
    if days is None:
        days = conf.current().registration_unused_days
    if days <= 0:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    unused = (
        Registration.objects.filter(last_push__isnull=True, updated__lt=cutoff)
        .exclude(Exists(Delivery.objects.filter(registration=OuterRef("pk"))))
        .exclude(Exists(DeadLetter.objects.filter(registration=OuterRef("pk"))))
    )
    for kept in features.kept_registrations():
        unused = unused.exclude(kept)
    removed = 0
    while batch := list(unused.order_by().values_list("id", flat=True)[:1000]):
        # Checked again in the DELETE: a push may have arrived since the batch was read.
        _, deleted = lifecycle.delete_logged(unused.filter(id__in=batch))
        removed += deleted.get(Registration._meta.label, 0)
    forget_counts()
    log.info("registration.unused_removed", extra={"registrations": removed, "days": days})
    return removed
