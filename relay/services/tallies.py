"""Publishes per minute by verdict, for the reports: the ones that never become a Delivery
(rate-limited, refused, coalesced, unavailable) and the accepted ones alike.

Called once per gateway batch with the batch's verdicts: ONE upsert statement, whatever the
batch size (tenant and app come from the component in the same statement), in a transaction
that does not wait for the WAL flush (bookkeeping, like the delivery records). A tally that
cannot be written is logged and dropped: the publishes were already answered, and a report
figure is not worth a `wait` to a user's server.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from relay.models import Registration
from relay.report_models import PublishVerdict

if TYPE_CHECKING:
    from relay.services.publishing import Publish, Verdict

log = logging.getLogger(__name__)

_DOMAIN_LENGTH = 255

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
) -> Counter[tuple[datetime, int, str, str, str]]:
    """(minute, component, provider, publishing domain, verdict) -> publishes."""
    now = now or timezone.now()
    counts: Counter[tuple[datetime, int, str, str, str]] = Counter()
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


def record_verdicts(
    publishes: Sequence[Publish],
    registrations: Mapping[tuple[int, str], Registration],
    verdicts: Sequence[Verdict],
    *,
    folded: Collection[int] = (),
) -> None:
    """Add a batch's verdicts to the per-minute tallies (one statement)."""
    counts = count_verdicts(publishes, registrations, verdicts, folded=folded)
    if not counts:
        return
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
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
            cursor.execute(_UPSERT.format(rows=rows), params)
    except DatabaseError as error:
        log.warning(
            "tallies.not_recorded",
            extra={"publishes": len(publishes), "error_type": type(error).__name__},
        )
