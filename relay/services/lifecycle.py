"""The registration lifecycle log the reports read (created, token renewed, died, removed).

Each change to registrations is recorded by one call placed right beside it in the service
that makes it (registrations, uwpx, delivery), so the log holds exactly what happened and
nothing else: ids, app, provider and time, never the token, JID, node or secret. Events of
one change are bulk-inserted in one statement. A registration deleted any other way (the
admin, an app, component or tenant deleted, a queryset's delete()) reaches `deleting` through
a pre_delete receiver (relay/receivers.py), so every removal is in the log.

`live_change` says how the number of live registrations moved (see `RegistrationEvent`):
the reports rebuild the live count of any past day from today's count and the changes since.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from relay.models import App, Registration
from relay.report_models import RegistrationEvent, RegistrationEventKind

_FIELDS = ("id", "app_id", "app__tenant_id", "service", "token", "dead_since")


def _tenants_of(app_ids: Iterable[int]) -> dict[int, int]:
    return dict(App.objects.filter(pk__in=set(app_ids)).values_list("id", "tenant_id"))


_EVENTS = RegistrationEvent._meta.db_table
_EVENT_SQL = (
    f"INSERT INTO {_EVENTS} (at, tenant_id, app_id, provider, registration_id, kind, live_change)"
    " VALUES "
)


def _record(rows: Sequence[dict[str, Any]], kind: str, at: datetime) -> None:
    """One insert for the events; `rows` carry id, app_id, app__tenant_id, service and the
    event's live_change. A plain multi-row INSERT: the ORM's bulk_create would be a large
    part of a Windows registration's CPU."""
    if not rows:
        return
    when = connection.ops.adapt_datetimefield_value(at)
    params: list[Any] = []
    for row in rows:
        params += [when, row["app__tenant_id"], row["app_id"], row["service"], row["id"]]
        params += [str(kind), row["live_change"]]
    values = ", ".join(["(%s, %s, %s, %s, %s, %s, %s)"] * len(rows))
    with connection.cursor() as cursor:
        cursor.execute(_EVENT_SQL + values, params)


def created(
    registrations: Sequence[Registration],
    *,
    at: datetime | None = None,
    tenant_id: int | None = None,
) -> None:
    """New registrations (saved, so they have ids): each is one more live registration.

    `tenant_id`, when the caller knows it (all of one app), saves looking it up."""
    if not registrations:
        return
    if tenant_id is not None:
        tenants = {registration.app_id: tenant_id for registration in registrations}
    else:
        tenants = _tenants_of(registration.app_id for registration in registrations)
    _record(
        [
            {
                "id": registration.pk,
                "app_id": registration.app_id,
                "app__tenant_id": tenants[registration.app_id],
                "service": registration.service,
                "live_change": 1,
            }
            for registration in registrations
        ],
        RegistrationEventKind.CREATED,
        at or timezone.now(),
    )


def renewed(registration: Registration, *, token: str, at: datetime | None = None) -> None:
    """The device registered again: a new token, or a dead registration brought back.

    `registration` is the row as it was before the update. Re-registering the same live token
    changes nothing and is not an event.
    """
    revived = registration.dead_since is not None
    if registration.token == token and not revived:
        return
    _record(
        [
            {
                "id": registration.pk,
                "app_id": registration.app_id,
                "app__tenant_id": _tenants_of([registration.app_id])[registration.app_id],
                "service": registration.service,
                "live_change": 1 if revived else 0,
            }
        ],
        RegistrationEventKind.RENEWED,
        at or timezone.now(),
    )


def renew_logged(
    registrations: QuerySet[Registration], *, token: str, at: datetime | None = None, **fields: Any
) -> int:
    """`registrations.update(token=token, **fields)` that logs the renewals it makes (a new
    token, or a dead registration revived when `dead_since=None` is among `fields`)."""
    at = at or timezone.now()
    reviving = "dead_since" in fields and fields["dead_since"] is None
    with transaction.atomic():
        rows = []
        for row in registrations.values(*_FIELDS):
            revived = reviving and row["dead_since"] is not None
            if row["token"] != token or revived:
                rows.append({**row, "live_change": 1 if revived else 0})
        updated = registrations.update(token=token, **fields)
        _record(rows, RegistrationEventKind.RENEWED, at)
    return updated


def died(registration_ids: Iterable[int], *, at: datetime) -> None:
    """Called right after `dead_since=at` was set on the registrations that were still live:
    those whose `dead_since` is exactly `at` are the ones this change killed."""
    ids = set(registration_ids)
    if not ids:
        return
    rows = [
        {**row, "live_change": -1}
        for row in Registration.objects.filter(pk__in=ids, dead_since=at).values(*_FIELDS)
    ]
    _record(rows, RegistrationEventKind.DIED, at)


# Registrations whose removal `delete_logged` records itself (in one insert): the
# per-registration path below (`deleting`) leaves them alone.
_logged_removals: ContextVar[frozenset[int]] = ContextVar("logged_removals", default=frozenset())


def delete_logged(
    registrations: QuerySet[Registration], *, at: datetime | None = None
) -> tuple[int, dict[str, int]]:
    """`registrations.delete()` that logs a removal for each registration deleted, in one
    insert (a removal it did not see, e.g. a row that matched since, is logged by `deleting`)."""
    at = at or timezone.now()
    with transaction.atomic():
        rows = [
            {**row, "live_change": -1 if row["dead_since"] is None else 0}
            for row in registrations.select_for_update(of=("self",)).values(*_FIELDS)
        ]
        token = _logged_removals.set(frozenset(row["id"] for row in rows))
        try:
            result = registrations.delete()
        finally:
            _logged_removals.reset(token)
        _record(rows, RegistrationEventKind.REMOVED, at)
    return result


def deleting(registration: Registration, *, at: datetime | None = None) -> None:
    """A registration is being deleted by any other way than `delete_logged` (the admin, an
    app, component or tenant deleted with it, a queryset's or an instance's delete()): log
    its removal, so that past days' live counts stay right. Called for each row just before
    it goes, inside the deletion's transaction (rolled back with it); the row is read again,
    so a stale instance cannot log a wrong live change."""
    if registration.pk is None or registration.pk in _logged_removals.get():
        return
    rows = [
        {**row, "live_change": -1 if row["dead_since"] is None else 0}
        for row in Registration.objects.filter(pk=registration.pk).values(*_FIELDS)
    ]
    _record(rows, RegistrationEventKind.REMOVED, at or timezone.now())
