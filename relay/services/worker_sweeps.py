"""The periodic duties every worker process runs itself: no other process is needed for an
accepted push to go out.

A push answered `result` may wait in two places that nothing consumes by itself: a deferred
send in the database (a retry, a busy app, a coalescing window: relay/services/deferred.py),
and a message RabbitMQ dead-lettered past its delivery limit
(relay/services/broker_dead_letters.py). A single beat process used to move both; with it
stopped, accepted pushes sat in the database until it ran again. Now each worker sweeps:

- the due deferred sends every RELAY_DEFERRED_SWEEP_SECONDS. Sweeps of several workers run
  side by side safely: on PostgreSQL each takes its rows FOR UPDATE SKIP LOCKED, SQLite
  serialises writers; a row is deleted in the transaction that published it, after the
  broker's confirm (at least once, never lost);
- the broker's dead letters every DEAD_LETTER_SECONDS (each message is taken by one worker).

As long as one worker runs, a due send is queued within one sweep interval (more while the
send queue is busy: relay/services/deferred.py), and with no worker running nothing is sent
anyway. The first round of each worker starts at a random point of the interval, so that
workers started together do not sweep in step.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.db import DatabaseError, connection

from relay import conf

log = logging.getLogger(__name__)

DEAD_LETTER_SECONDS = 30.0


@dataclass
class _Duty:
    name: str
    every: float
    run: Callable[[], object]
    next_at: float = 0.0


def _sweep_deferred() -> object:
    from relay.services import deferred

    return deferred.sweep_due()


def _collect_dead_letters() -> object:
    from relay.services import broker_dead_letters

    if not broker_dead_letters.is_rabbitmq():
        return 0
    return broker_dead_letters.collect()


class Sweeper:
    """A daemon thread running the duties on their schedules until `stop()`."""

    def __init__(self, duties: list[_Duty] | None = None) -> None:
        self._duties = duties if duties is not None else default_duties()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay-sweeper", daemon=True)

    def start(self) -> Sweeper:
        now = time.monotonic()
        for duty in self._duties:
            duty.next_at = now + random.uniform(0, duty.every)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            now = time.monotonic()
            for duty in self._duties:
                if duty.next_at <= now and not self._stopping.is_set():
                    self._do(duty)
                    duty.next_at = max(duty.next_at + duty.every, time.monotonic())
            nearest = min(duty.next_at for duty in self._duties)
            self._stopping.wait(max(0.0, nearest - time.monotonic()))

    @staticmethod
    def _do(duty: _Duty) -> None:
        """One round of a duty; a failure (database or broker away) waits for the next."""
        try:
            duty.run()
        except Exception as error:  # any: this thread must outlive what it meets
            log.warning(
                "worker.sweep_failed",
                extra={"duty": duty.name, "error_type": type(error).__name__},
            )
        finally:
            # No connection held between rounds: a forked pool child would inherit it, and a
            # database restart would leave it dead.
            with contextlib.suppress(DatabaseError):
                connection.close()


def default_duties() -> list[_Duty]:
    return [
        _Duty("deferred", conf.current().deferred_sweep_seconds, _sweep_deferred),
        _Duty("broker_dead_letters", DEAD_LETTER_SECONDS, _collect_dead_letters),
    ]
