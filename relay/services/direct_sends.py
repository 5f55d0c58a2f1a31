"""The gateway sends an everyday push itself, and answers once it is delivered or kept.

At an everyday rate every push is a batch of one, and each hop costs more than the push: a
confirmed broker message (RabbitMQ's CPU), a worker waking for it, its message machinery and
its own read of the registration. So while the gateway has CPU to spare, it sends the wake-up
itself, through the same `delivery.deliver_many` a worker runs, and answers the publish
after that call returned, that is once the push is delivered, deferred for a retry (a row in
the database) or a dead letter: the same guarantee as an answer after the broker's confirm.
Only what this path cannot keep goes through the broker: the sends of a busy gateway (its CPU
over `RELAY_DIRECT_SEND_SHARE`, or `RELAY_DIRECT_SENDS_IN_FLIGHT` batches already being sent),
the sends of an app whose provider is slow or stalled here, retries (the workers' sweep), a
batch whose registrations the database did not give (nothing was sent yet), and bookkeeping
the database did not take after the sends (`relay.record_outcomes`).

A gateway killed mid-send leaves its publishes unanswered: the user's server counts them as
failed, and a wake-up that did go out is harmless twice. A publish is never answered `result`
for a push that is neither delivered nor kept somewhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from relay.models import Registration
from relay.providers.base import Outcome
from relay.services import delivery, publishing, queue
from relay.services import provider_limits as limits
from relay.services.delivery_journal import Journal

log = logging.getLogger(__name__)

RECORD_OUTCOMES = "relay.record_outcomes"
# How often the gateway's own CPU is read (seconds): the share is over this window.
WINDOW_SECONDS = 0.5
# The most sends of one app's batch that go out here; the rest of a bigger batch goes to the
# workers. An everyday batch holds one; a bigger one means pushes are arriving fast: the
# gateway sends its share beside the workers, within its CPU share, and answers those
# publishes after their sends, which stay few so that none waits long for the others (what
# it costs and saves: docs/benchmarks.md, Relay end to end).
JOBS_MAX = 4


class Budget:
    """Whether this process may send one more app's batch itself now (`claim`, then
    `release` once sent); per process, thread-safe."""

    def __init__(
        self,
        *,
        share: float,
        in_flight: int,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self.share = max(0.0, share)
        self.in_flight = max(0, in_flight) if self.share else 0
        self.per_app = max(1, self.in_flight // 2)
        self._clock = clock
        self._cpu = cpu
        self._lock = threading.Lock()
        self._since: dict[int, list[float]] = {}  # app -> when each batch in flight started
        self._window_start = (clock(), cpu())
        self._busy = 0.0

    def _over_share(self, now: float) -> bool:
        started, cpu_then = self._window_start
        if now - started >= WINDOW_SECONDS:
            cpu_now = self._cpu()
            self._busy = (cpu_now - cpu_then) / (now - started)
            self._window_start = (now, cpu_now)
        return self._busy >= self.share

    def claim(self, app: int, jobs: int = 1) -> int:
        """How many of `jobs` sends of `app` this process sends itself now: at most
        JOBS_MAX, or none."""
        if not self.in_flight or jobs < 1:
            return 0
        now = self._clock()
        with self._lock:
            started = self._since.get(app, [])
            if self._held() >= self.in_flight or len(started) >= self.per_app:
                return 0
            if started and now - min(started) >= limits.SLOW_SECONDS:
                return 0  # its provider is slow here: the workers take its sends
            if limits.app_breaker_open(app) or self._over_share(now):
                return 0
            self._since.setdefault(app, []).append(now)
            return min(jobs, JOBS_MAX)

    def release(self, app: int) -> None:
        with self._lock:
            started = self._since.get(app)
            if started:
                started.remove(min(started))
            if not started:
                self._since.pop(app, None)

    def _held(self) -> int:
        return sum(len(started) for started in self._since.values())

    def held(self) -> int:
        """Batches being sent now."""
        with self._lock:
            return self._held()


def send_planned(
    plan: publishing.Plan, send: publishing.DirectSend, journal: Journal | None = None
) -> list[publishing.Verdict]:
    """Send a planned `DirectSend` and give its publishes their verdicts."""
    return publishing.answer_direct(plan, send, send_jobs(send.jobs, send.registrations, journal))


def send_jobs(
    jobs: list[queue.SendJob],
    registrations: dict[int, Registration] | None = None,
    journal: Journal | None = None,
) -> list[bool]:
    """Send one app's jobs in this process (with their registrations as just read, if given);
    per job, whether it may be answered `result` (delivered, or kept: deferred,
    dead-lettered, or queued in the broker). A delivered batch's bookkeeping goes to the
    `journal`, if given, instead of the database."""
    try:
        outcomes = delivery.deliver_many(
            jobs, registrations=registrations, keep=journal.keep if journal else None
        )
    except delivery.DatabaseUnavailable:
        # Nothing was sent: the broker takes the jobs as if they had never come here.
        return [_queued(jobs)] * len(jobs)
    except delivery.RecordPending as pending:
        if _record_later(pending.bookkeeping.to_message()):
            return [True] * len(jobs)
        # A push delivered (or known dead) is done; a retry or a dead letter that no store
        # took exists nowhere: its publish is answered `wait`.
        done = {Outcome.DELIVERED, Outcome.DEAD_TOKEN}
        return [outcome in done for outcome in pending.outcomes]
    log.debug("direct.sent", extra={"jobs": len(jobs), "outcomes": len(outcomes)})
    return [True] * len(jobs)


def _queued(jobs: list[queue.SendJob]) -> bool:
    try:
        queue.enqueue_sends(jobs)
    except queue.QueueUnavailable:
        return False
    return True


def _record_later(bookkeeping: dict[str, Any]) -> bool:
    """What the sends taught, kept in the broker until the database is back."""
    try:
        queue.publish_task(RECORD_OUTCOMES, [bookkeeping])
    except queue.QueueUnavailable:
        log.warning("direct.record_not_queued", extra={"jobs": len(bookkeeping["deliveries"])})
        return False
    log.warning("direct.record_queued", extra={"jobs": len(bookkeeping["deliveries"])})
    return True
