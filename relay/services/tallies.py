"""Publishes per minute by verdict, for the reports: the ones that never become a Delivery
(rate-limited, refused, coalesced, unavailable) and the accepted ones alike.

Called once per gateway batch with the batch's verdicts, which are summed in memory and
written at most every RELAY_TALLY_FLUSH_SECONDS (and when the gateway stops): ONE upsert
statement per flush, whatever was summed (tenant and app come from the component in the same
statement), in a transaction that does not wait for the WAL flush (bookkeeping, like the
delivery records). At an everyday rate every batch is one publish: an upsert per batch
would cost the gateway and PostgreSQL more than the publish itself.

A gateway killed outright loses what it had not written yet (at most that interval), never
a push. Tallies the database refuses are kept for the next flush (up to MAX_PENDING_KEYS, then
logged and dropped): the publishes were already answered, and a report figure is not worth a
`wait` to a user's server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from relay import conf
from relay.models import Registration
from relay.report_models import PublishVerdict

if TYPE_CHECKING:
    from relay.services.publishing import Publish, Verdict

log = logging.getLogger(__name__)

_DOMAIN_LENGTH = 255
# (minute, component, provider, publishing domain, verdict)
Key = tuple[datetime, int, str, str, str]

_UPSERT = """
WITH batch (minute, component_id, provider, publishing_domain, verdict, n) AS (VALUES {rows})
INSERT INTO relay_publishtally
    (minute, tenant_id, app_id, provider, publishing_domain, verdict, count)
SELECT batch.minute, c.tenant_id, c.app_id, batch.provider, batch.publishing_domain,
       batch.verdict, SUM(batch.n)
FROM batch JOIN relay_component c ON c.id = batch.component_id
WHERE true
GROUP BY batch.minute, c.tenant_id, c.app_id, batch.provider, batch.publishing_domain,
         batch.verdict
ON CONFLICT (minute, tenant_id, app_id, provider, publishing_domain, verdict)
DO UPDATE SET count = relay_publishtally.count + excluded.count
"""


def _minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def count_verdicts(
    publishes: Sequence[Publish],
    registrations: Mapping[tuple[int, str], Registration],
    verdicts: Sequence[Verdict],
    *,
    folded: Collection[int] = (),
    now: datetime | None = None,
) -> Counter[Key]:
    """(minute, component, provider, publishing domain, verdict) -> publishes."""
    now = now or timezone.now()
    counts: Counter[Key] = Counter()
    for index, (publish, verdict) in enumerate(zip(publishes, verdicts, strict=True)):
        registration = registrations.get((publish.component_id, publish.node))
        name = verdict.value
        if index in folded and name == PublishVerdict.ACCEPTED:
            name = PublishVerdict.COALESCED
        key = (
            _minute(publish.received or now),
            publish.component_id,
            registration.service if registration is not None else "",
            publish.publishing_domain[:_DOMAIN_LENGTH].lower(),
            str(name),
        )
        counts[key] += 1
    return counts


MAX_PENDING_KEYS = 10_000
_lock = threading.Lock()
_pending: Counter[Key] = Counter()
_last_flush = float("-inf")  # the first batch is written at once


def record_verdicts(
    publishes: Sequence[Publish],
    registrations: Mapping[tuple[int, str], Registration],
    verdicts: Sequence[Verdict],
    *,
    folded: Collection[int] = (),
) -> None:
    """Add a batch's verdicts to the per-minute tallies; written now if the last write is
    RELAY_TALLY_FLUSH_SECONDS old."""
    counts = count_verdicts(publishes, registrations, verdicts, folded=folded)
    if not counts:
        return
    with _lock:
        _pending.update(counts)
        due = time.monotonic() - _last_flush >= conf.current().tally_flush_seconds
    if due:
        flush()


def due_in() -> float:
    """Seconds until the tallies summed since the last write are due to be written."""
    with _lock:
        return _last_flush + conf.current().tally_flush_seconds - time.monotonic()


def pending() -> int:
    """Publishes counted but not written yet."""
    with _lock:
        return sum(_pending.values())


def flush() -> None:
    """Write every tally summed so far (one statement); the gateway calls it on a timer."""
    global _last_flush
    with _lock:
        counts = Counter(_pending)
        _pending.clear()
        _last_flush = time.monotonic()
    if not counts:
        return
    try:
        _write(counts)
    except DatabaseError as error:
        with _lock:
            keep = len(_pending) + len(counts) <= MAX_PENDING_KEYS
            if keep:
                _pending.update(counts)
        log.warning(
            "tallies.not_recorded",
            extra={
                "publishes": sum(counts.values()),
                "kept": keep,
                "error_type": type(error).__name__,
            },
        )


def _write(counts: Counter[Key]) -> None:
    params: list[Any] = []
    for (minute, component_id, provider, domain, verdict), n in counts.items():
        params += [
            connection.ops.adapt_datetimefield_value(minute),
            component_id,
            provider,
            domain,
            verdict,
            n,
        ]
    # Typed once in the first row so PostgreSQL knows the VALUES columns' types.
    first = "(CAST(%s AS {ts}), CAST(%s AS BIGINT), %s, %s, %s, CAST(%s AS BIGINT))".format(
        ts="timestamptz" if connection.vendor == "postgresql" else "text"
    )
    rows = ", ".join([first] + ["(%s, %s, %s, %s, %s, %s)"] * (len(counts) - 1))
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL synchronous_commit TO OFF")
        cursor.execute(_UPSERT.format(rows=rows), params)
