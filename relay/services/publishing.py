"""Accepting an XEP-0357 publish from a user's server and queueing its send.

The answer decides whether users keep their push (docs/protocols.md 1.3): ejabberd drops a
registration after ONE error that is not `wait`, so every passing trouble must map to a `wait`
verdict (UNAVAILABLE, RATE_LIMITED), and only a dead or unknown node, a wrong secret or a
domain the tenant does not allow to a hard one:

| situation                                         | verdict       | XMPP error         |
|---------------------------------------------------|---------------|--------------------|
| queued or deferred (or folded into a pending one) | ACCEPTED      | none (`result`)    |
| unknown node, or the token is known dead          | UNKNOWN_NODE  | cancel item-not-found |
| wrong secret                                      | FORBIDDEN     | auth forbidden     |
| publishing domain not in the tenant's allowed list| FORBIDDEN     | auth forbidden     |
| tenant suspended; database or queue down          | UNAVAILABLE   | wait               |
| tenant over its rate limit                        | RATE_LIMITED  | wait resource-constraint |

A suspension is a passing state (billing, abuse review): registrations must survive it, so it
is `wait`. A domain the tenant removed from its allowed list is the tenant's lasting decision:
`forbidden` lets the user's server disable push for that account instead of publishing into the
void forever (Prosody never stops on `wait`), and the phone re-registers by itself once the
domain is allowed again.

The hot path is one database query, at most one round trip to the throttling store, and the
broker publish, each shared by a batch of publishes (`accept_publishes`; the gateway gathers
the publishes that arrive within a few milliseconds).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hmac
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from relay import metrics
from relay.models import App, Registration, Tenant
from relay.services import deferred, queue, tallies, throttling

log = logging.getLogger(__name__)


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    UNKNOWN_NODE = "unknown-node"
    FORBIDDEN = "forbidden"
    UNAVAILABLE = "unavailable"
    RATE_LIMITED = "rate-limited"


@dataclass(frozen=True, slots=True)
class Publish:
    """A parsed publish; the body and sender are dropped before this is built."""

    component_id: int
    publishing_domain: str
    node: str
    secret: str
    important: bool
    message_count: int | None = None
    pending_subscription_count: int | None = None
    received: datetime | None = None


def domain_allowed(*, allowed_domains: str, domain: str) -> bool:
    """Whether a tenant's allowed list (one per line; `*.example.org` for subdomains; empty
    allows any) admits `domain`."""
    patterns = [line.strip().lower() for line in allowed_domains.splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    if not patterns:
        return True
    domain = domain.strip().lower().rstrip(".")
    for pattern in patterns:
        if pattern.startswith("*."):
            if domain.endswith(pattern[1:]):
                return True
        elif domain == pattern:
            return True
    return False


# Every column: a send this gateway makes itself (relay/services/direct_sends.py) goes out
# with the registration read here, without a read of its own.
_REGISTRATION_COLUMNS = frozenset(field.attname for field in Registration._meta.concrete_fields)
_TENANT_COLUMNS = frozenset(
    {
        "id",
        "created",
        "suspended",
        "allowed_domains",
        "rate_limit_per_second",
        "rate_limit_burst",
    }
)


@dataclass(frozen=True, slots=True)
class _Lookup:
    sql: str  # without the WHERE condition
    registration_columns: tuple[str, ...]  # in the model's field order (Model.from_db)
    tenant_columns: tuple[str, ...]


def _in_model_order(model: type[Any], wanted: frozenset[str]) -> tuple[str, ...]:
    return tuple(f.attname for f in model._meta.concrete_fields if f.attname in wanted)


@functools.cache
def _lookup() -> _Lookup:
    """The lookup's SELECT, written once: compiling the ORM query per batch would cost as
    much as the rest of a batch of one."""
    registration_columns = _in_model_order(Registration, _REGISTRATION_COLUMNS)
    tenant_columns = _in_model_order(Tenant, _TENANT_COLUMNS)
    columns = [f"r.{c}" for c in registration_columns] + [f"t.{c}" for c in tenant_columns]
    columns.append("a.updated")
    quote = connection.ops.quote_name
    sql = (
        f"SELECT {', '.join(columns)} FROM {quote(Registration._meta.db_table)} r"
        f" JOIN {quote(App._meta.db_table)} a ON a.id = r.app_id"
        f" JOIN {quote(Tenant._meta.db_table)} t ON t.id = a.tenant_id WHERE "
    )
    return _Lookup(sql, registration_columns, tenant_columns)


def _orm_value(column: str, value: Any) -> Any:
    """A column as the ORM would give it: SQLite hands a raw cursor naive UTC times and
    integers for booleans."""
    if isinstance(value, datetime) and timezone.is_naive(value):
        return timezone.make_aware(value, UTC)
    if column == "suspended":
        return bool(value)
    return value


def _find_registrations(publishes: list[Publish]) -> dict[tuple[int, str], Registration]:
    """Every registration the batch names, in ONE query, by (component, node) (unique), with
    its app (id only) and tenant (the policy fields): deferred model instances built straight
    from the rows, one App and Tenant per batch each, not per row."""
    nodes: dict[int, set[str]] = {}
    for publish in publishes:
        nodes.setdefault(publish.component_id, set()).add(publish.node)
    conditions = []
    params: list[Any] = []
    for component_id, component_nodes in nodes.items():
        conditions.append(
            f"(r.component_id = %s AND r.node IN ({', '.join(['%s'] * len(component_nodes))}))"
        )
        params += [component_id, *sorted(component_nodes)]
    lookup = _lookup()
    with connection.cursor() as cursor:
        cursor.execute(lookup.sql + " OR ".join(conditions), params)
        rows = cursor.fetchall()
    found: dict[tuple[int, str], Registration] = {}
    apps: dict[int, App] = {}
    tenants: dict[int, Tenant] = {}
    width = len(lookup.registration_columns)
    for row in rows:
        values = dict(zip(lookup.registration_columns, row[:width], strict=True))
        tenant_values = dict(zip(lookup.tenant_columns, row[width:-1], strict=True))
        tenant = tenants.get(tenant_values["id"])
        if tenant is None:
            tenant = Tenant.from_db(
                connection.alias,
                lookup.tenant_columns,
                [_orm_value(c, v) for c, v in tenant_values.items()],
            )
            tenants[tenant.pk] = tenant
        app = apps.get(values["app_id"])
        if app is None:
            app = App.from_db(
                connection.alias,
                ("id", "tenant_id", "updated"),
                (values["app_id"], tenant.pk, _orm_value("updated", row[-1])),
            )
            app.tenant = tenant
            apps[app.pk] = app
        registration = Registration.from_db(
            connection.alias,
            lookup.registration_columns,
            [_orm_value(c, v) for c, v in values.items()],
        )
        registration.app = app
        found[(registration.component_id, registration.node)] = registration
    return found


def accept_publish(publish: Publish) -> Verdict:
    """Check node, secret and tenant policy, then queue the send durably before answering."""
    return accept_publishes([publish])[0]


@dataclass(slots=True)
class _Pending:
    """A publish that passed the checks and waits for its throttling decision and queueing."""

    index: int
    publish: Publish
    registration: Registration
    push_id: str
    received: datetime


@dataclass(slots=True)
class DirectSend:
    """One app's sends that the caller sends itself (relay/services/direct_sends.py) before
    it answers their publishes: `indices` are the publishes its outcome answers, the ones
    folded into its sends included."""

    app: int
    jobs: list[queue.SendJob]
    indices: list[int]
    registrations: dict[int, Registration]  # the jobs', as the lookup read them
    folded: dict[int, str] = dataclasses.field(default_factory=dict)  # index -> push id it joined


@dataclass(slots=True)
class Plan:
    """A batch's verdicts, None for the publishes a `DirectSend` answers."""

    publishes: list[Publish]
    found: dict[tuple[int, str], Registration]
    verdicts: list[Verdict | None]
    direct: list[DirectSend]


def accept_publishes(publishes: list[Publish]) -> list[Verdict]:
    """`accept_publish` for a batch, one verdict per publish in order: one database query,
    one throttling round trip, and ONE broker message per app for the sends that go out now.

    A publish is ACCEPTED only once its job (or the pending send it folded into) is in the
    broker, or in the database when it is delayed; when the batch message cannot be queued,
    every publish that needed it is answered UNAVAILABLE (`wait`) and nothing of the batch is
    queued.
    """
    plan = plan_publishes(publishes)
    return [verdict or Verdict.UNAVAILABLE for verdict in plan.verdicts]


def plan_publishes(
    publishes: list[Publish], *, claim: Callable[[int, int], int] | None = None
) -> Plan:
    """`accept_publishes`, but of an app's sends that go out now, the first
    `claim(app id, number of sends)` are left to the caller, which sends them itself: they
    come back as a `DirectSend`, their publishes unanswered until `answer_direct`; the rest
    go to the broker."""
    now = timezone.now()
    verdicts: list[Verdict | None] = [None] * len(publishes)
    try:
        found = _find_registrations(publishes)
    except DatabaseError:
        log.warning("publish.database_unavailable", extra={"publishes": len(publishes)})
        metrics.count_publishes(("", Verdict.UNAVAILABLE.value) for _ in publishes)
        return Plan(publishes, {}, [Verdict.UNAVAILABLE] * len(publishes), [])
    pending: list[_Pending] = []
    bound: dict[int, str] = {}  # account domains bound by this batch
    for index, publish in enumerate(publishes):
        registration = found.get((publish.component_id, publish.node))
        verdict = _check(publish, registration, bound)
        if verdict is not None:
            verdicts[index] = verdict
            continue
        assert registration is not None
        pending.append(
            _Pending(index, publish, registration, str(uuid.uuid4()), publish.received or now)
        )

    admissions = throttling.admit_many(
        requests=[
            throttling.AdmitRequest(
                tenant=item.registration.app.tenant,
                registration=item.registration,
                push_id=item.push_id,
                fold=throttling.Fold(
                    important=item.publish.important,
                    message_count=item.publish.message_count,
                    pending_subscription_count=item.publish.pending_subscription_count,
                ),
            )
            for item in pending
        ]
    )
    now_jobs: list[tuple[_Pending, queue.SendJob]] = []
    later_jobs: list[tuple[_Pending, queue.SendJob, float]] = []
    folded: list[tuple[_Pending, str]] = []
    for item, admission in zip(pending, admissions, strict=True):
        if admission.decision is throttling.Decision.LIMITED:
            log.info(
                "publish.rate_limited",
                extra={
                    "tenant": item.registration.app.tenant.pk,
                    "retry_in": round(admission.delay, 3),
                },
            )
            verdicts[item.index] = Verdict.RATE_LIMITED
        elif admission.decision is throttling.Decision.FOLDED:
            folded.append((item, admission.push_id))
        else:
            scheduled = admission.decision is throttling.Decision.SCHEDULE
            job = _job(item, coalesced=scheduled)
            if scheduled:
                later_jobs.append((item, job, admission.delay))
            else:
                now_jobs.append((item, job))

    failed_push_ids: set[str] = set()
    # One message per app: sends are acknowledged when their whole message is done, so a
    # message shared with another tenant's stuck provider would hold this app's bookkeeping.
    per_app: dict[int, list[tuple[_Pending, queue.SendJob]]] = {}
    for item, job in now_jobs:
        per_app.setdefault(item.registration.app_id, []).append((item, job))
    direct: dict[str, DirectSend] = {}  # by push id
    for app_id, app_jobs in per_app.items():
        taken = claim(app_id, len(app_jobs)) if claim is not None else 0
        mine, theirs = app_jobs[:taken], app_jobs[taken:]
        if mine:
            send = DirectSend(
                app_id,
                [job for _, job in mine],
                [item.index for item, _ in mine],
                {item.registration.pk: item.registration for item, _ in mine},
            )
            direct.update((item.push_id, send) for item, _ in mine)
        if not theirs:
            continue
        try:
            queue.enqueue_sends([job for _, job in theirs])
        except queue.QueueUnavailable:
            log.warning("publish.queue_unavailable", extra={"publishes": len(theirs)})
            failed_push_ids |= {item.push_id for item, _ in theirs}
    # The broker is failing: what needed it is answered `wait`, the delayed sends too; the
    # caller's own sends (`direct`) go on.
    if failed_push_ids:
        failed_push_ids |= {item.push_id for item, _, _ in later_jobs}
    elif later_jobs:
        # A delayed send (a repeat publish inside its coalescing window) waits in the
        # database until due; the workers' sweep queues it (relay/services/deferred.py).
        try:
            _defer(later_jobs)
        except DatabaseError:
            log.warning("publish.defer_failed", extra={"publishes": len(later_jobs)})
            failed_push_ids |= {item.push_id for item, _, _ in later_jobs}
    for item, _, _ in later_jobs:
        if item.push_id in failed_push_ids:
            throttling.abandon(registration=item.registration, push_id=item.push_id)
    for item in [item for item, _ in now_jobs] + [item for item, _, _ in later_jobs]:
        if item.push_id in direct:
            continue
        failed = item.push_id in failed_push_ids
        verdicts[item.index] = Verdict.UNAVAILABLE if failed else Verdict.ACCEPTED
    for item, into in folded:
        if into in direct:  # answered with the send it folded into
            direct[into].indices.append(item.index)
            direct[into].folded[item.index] = into
        elif into in failed_push_ids:
            # Folded into a send this batch failed to queue: that send does not exist.
            verdicts[item.index] = Verdict.UNAVAILABLE
        else:
            log.info("publish.coalesced", extra={"push_id": into})
            verdicts[item.index] = Verdict.ACCEPTED
    sends = list({id(send): send for send in direct.values()}.values())
    answered = {index for send in sends for index in send.indices}
    decided = [index for index in range(len(publishes)) if index not in answered]
    for index in decided:
        verdicts[index] = verdicts[index] or Verdict.UNAVAILABLE
    folded_indices = {item.index for item, _ in folded}
    _tally(publishes, found, decided, verdicts, folded_indices)
    return Plan(publishes, found, verdicts, sends)


def answer_direct(plan: Plan, send: DirectSend, kept: list[bool]) -> list[Verdict]:
    """The verdicts of a `DirectSend`'s publishes (in `send.indices` order), given whether each
    of its jobs was delivered or kept (relay/services/direct_sends.py); a folded publish
    follows the send it folded into."""
    kept_by_push = {job.push_id: ok for job, ok in zip(send.jobs, kept, strict=True)}
    # The jobs' own publishes come first in `indices`, then the folded ones.
    push_of = {index: job.push_id for index, job in zip(send.indices, send.jobs, strict=False)}
    push_of.update(send.folded)
    for index in send.indices:
        ok = kept_by_push[push_of[index]]
        plan.verdicts[index] = Verdict.ACCEPTED if ok else Verdict.UNAVAILABLE
    _tally(plan.publishes, plan.found, send.indices, plan.verdicts, set(send.folded))
    return [plan.verdicts[index] or Verdict.UNAVAILABLE for index in send.indices]


def _tally(
    publishes: list[Publish],
    found: dict[tuple[int, str], Registration],
    indices: list[int],
    verdicts: list[Verdict | None],
    folded: set[int],
) -> None:
    """Count the verdicts of these publishes, for the reports and the metrics."""
    chosen = [publishes[index] for index in indices]
    answers = [verdicts[index] or Verdict.UNAVAILABLE for index in indices]
    folded_here = {position for position, index in enumerate(indices) if index in folded}
    tallies.record_verdicts(chosen, found, answers, folded=folded_here)
    _count(chosen, found, answers)


def _defer(later_jobs: list[tuple[_Pending, queue.SendJob, float]]) -> None:
    now = timezone.now()
    rows = [
        deferred.row(
            job,
            delay,
            tenant_id=item.registration.app.tenant_id,
            app_id=item.registration.app_id,
            now=now,
        )
        for item, job, delay in later_jobs
    ]
    with transaction.atomic():
        deferred.write(rows)


def _count(
    publishes: list[Publish],
    found: dict[tuple[int, str], Registration],
    answers: list[Verdict],
) -> None:
    """The batch's verdicts by tenant (id; empty when the node is unknown)."""

    def tenant(publish: Publish) -> str:
        registration = found.get((publish.component_id, publish.node))
        return str(registration.app.tenant.pk) if registration is not None else ""

    pairs = zip(publishes, answers, strict=True)
    metrics.count_publishes((tenant(publish), verdict.value) for publish, verdict in pairs)


def _check(
    publish: Publish, registration: Registration | None, bound: dict[int, str]
) -> Verdict | None:
    """The verdict of the node, secret and tenant checks, or None when the publish passes."""
    if registration is None or registration.dead_since is not None:
        return Verdict.UNKNOWN_NODE
    domain = bound.get(registration.pk, registration.account_domain)
    if domain not in (publish.publishing_domain, ""):
        return Verdict.UNKNOWN_NODE
    if not hmac.compare_digest(registration.secret.encode(), publish.secret.encode()):
        # DEBUG: the gateway logs the verdict (publish.answered); two lines per wrong secret
        # made a flood of them twice as costly.
        log.debug("publish.forbidden", extra={"component": publish.component_id})
        return Verdict.FORBIDDEN
    if not domain:
        # The UWPX client names accounts by hash only (relay.windows.services): the first server
        # to publish with the right node and secret owns the registration from now on.
        try:
            Registration.objects.filter(pk=registration.pk, account_domain="").update(
                account_domain=publish.publishing_domain
            )
        except DatabaseError:
            return Verdict.UNAVAILABLE
        bound[registration.pk] = publish.publishing_domain
    tenant = registration.app.tenant
    if tenant.suspended:
        log.info("publish.tenant_suspended", extra={"tenant": tenant.pk})
        return Verdict.UNAVAILABLE
    if not domain_allowed(allowed_domains=tenant.allowed_domains, domain=publish.publishing_domain):
        log.info("publish.domain_not_allowed", extra={"tenant": tenant.pk})
        return Verdict.FORBIDDEN
    return None


def _job(item: _Pending, *, coalesced: bool) -> queue.SendJob:
    return queue.SendJob(
        push_id=item.push_id,
        registration_id=item.registration.pk,
        publishing_domain=item.publish.publishing_domain,
        important=item.publish.important,
        message_count=item.publish.message_count,
        pending_subscription_count=item.publish.pending_subscription_count,
        received=item.received.isoformat(),
        coalesced=coalesced,
        app=item.registration.app_id,
    )
