"""The brokers: RabbitMQ's queues (production), and the embedded SQLite transport.

RabbitMQ (docs/broker.md): the send tasks travel through ONE quorum queue (`send_queue`,
replicated on every node, confirmed publishes, acknowledged late). A send delivered
`CELERY_DELIVERY_LIMIT` times without an acknowledgement (a poison message that kills its
worker each time) is dead-lettered, at least once, to `<queue>.dead` (`dead_letter_queue`),
from where the workers' sweep (relay/services/worker_sweeps.py) records it among the relay's
dead letters.

The embedded broker: kombu's SQLAlchemy transport with leases instead of hiding.

kombu's own SQLAlchemy transport marks a message invisible when a worker takes it and never
shows it again; acknowledgements live only in the worker's memory. A worker killed with
SIGKILL therefore loses every send it had in flight or prefetched, although sends are
acknowledged late. This transport gives the SQLite file the guarantees Redis gives:

- taking a message leases it: the row turns invisible and is stamped; once the lease is
  older than ``visibility_timeout`` (transport option, default ``CELERY_VISIBILITY_TIMEOUT``,
  3600 s) the row is handed out again. Celery holds countdown/ETA messages unacknowledged,
  so the timeout must exceed the longest retry delay;
- an ack (or a reject without requeue) deletes the row; a reject with requeue, or a channel
  closing with unacknowledged messages, makes the row visible again (no new row).

Every lease bumps the row's ``version``; the delivery tag names row and lease, so releasing
an old lease never touches a row that another worker leased since.

URL: ``sqlrelay+<SQLAlchemy URL>``, e.g. ``sqlrelay+sqlite:///var/relay-broker.sqlite3``
(registered in pushsite/celery.py). Lease times are this host's UTC clock, so hosts that
share one broker database need synchronised clocks.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from json import loads
from queue import Empty
from typing import Any

from kombu import Exchange, Queue
from kombu.transport import sqlalchemy as kombu_sqlalchemy
from kombu.transport import virtual
from kombu.transport.sqlalchemy.models import metadata
from kombu.utils.encoding import bytes_to_str
from sqlalchemy import create_engine, delete, or_, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import sessionmaker

from relay.environment import Environment

log = logging.getLogger(__name__)

ALIAS = "sqlrelay"
DEFAULT_VISIBILITY_TIMEOUT = 3600
LEASE_PROPERTY = "x_relay_lease"  # [row id, lease version] in the message properties
# Transport options meant for kombu/Celery, not for sqlalchemy.create_engine().
_NOT_ENGINE_OPTIONS = (
    "visibility_timeout",
    "polling_interval",
    "queue_tablename",
    "message_tablename",
    "callback",
    "errback",
    "max_retries",
    "interval_start",
    "interval_step",
    "interval_max",
    "retry_errors",
)
_VERSION_WRAP = 30000  # the version column is a SMALLINT

_MUTEX = threading.RLock()
# One engine per process and URL: a forked process must not reuse its parent's connections.
_ENGINES: dict[tuple[int, str], tuple[Engine, sessionmaker]] = {}


def default_visibility_timeout() -> int:
    return Environment().celery_visibility_timeout


# --- RabbitMQ


def dead_letter_name(queue: str) -> str:
    return f"{queue}.dead"


def send_queue(env: Environment) -> Queue:
    """The quorum queue of the send tasks, behind a topic exchange of the same name (Celery's
    native delayed delivery binds topic exchanges only). Declared by every worker and by the
    gateway's publisher with these same arguments (RabbitMQ refuses a declaration that
    differs: change them with a policy, docs/broker.md)."""
    name = env.celery_queue
    dead = dead_letter_name(name)
    return Queue(
        name,
        Exchange(name, type="topic", durable=True),
        routing_key=name,
        durable=True,
        queue_arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": env.celery_delivery_limit,
            "x-dead-letter-exchange": dead,
            "x-dead-letter-routing-key": dead,
            # Dead-lettered with confirms between the queues: not lost if a node dies midway.
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",  # at-least-once dead-lettering requires it
        },
    )


def dead_letter_queue(env: Environment) -> Queue:
    """Where RabbitMQ puts a send past its delivery limit; nothing consumes it but the
    workers' sweep that records its messages as dead letters (so it is not in
    CELERY_TASK_QUEUES)."""
    dead = dead_letter_name(env.celery_queue)
    return Queue(
        dead,
        Exchange(dead, type="direct", durable=True),
        routing_key=dead,
        durable=True,
        queue_arguments={"x-queue-type": "quorum"},
    )


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(tzinfo=None)


def lease_of(message: Any) -> tuple[int, int] | None:
    """The (row id, lease version) a delivered message came from, if it came from a lease."""
    lease = (getattr(message, "properties", None) or {}).get(LEASE_PROPERTY)
    if not lease:
        return None
    row_id, version = lease
    return int(row_id), int(version)


class LeaseQoS(virtual.QoS):
    """Acks and rejects act on the row; they may come from other threads (threads pool)."""

    def ack(self, delivery_tag: str) -> None:
        message = self._delivered.get(delivery_tag)
        if message is not None:
            self.channel._forget(message)
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        message = self._delivered.get(delivery_tag)
        if message is not None:
            if requeue:
                self.channel._release(message)
            else:
                self.channel._forget(message)
        self._quick_ack(delivery_tag)


class Channel(kombu_sqlalchemy.Channel):
    """A channel whose `_get` leases rows; acks delete them, requeues release them."""

    QoS = LeaseQoS

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._pid = os.getpid()
        options = connection.client.transport_options
        self.visibility_timeout = float(
            options.get("visibility_timeout") or default_visibility_timeout()
        )

    # --- engine and tables

    def _engine_from_config(self) -> Engine:
        conninfo = self.connection.client
        options = {
            key: value
            for key, value in conninfo.transport_options.items()
            if key not in _NOT_ENGINE_OPTIONS
        }
        return create_engine(conninfo.hostname, **options)

    def _open(self) -> tuple[Engine, sessionmaker]:
        key = (os.getpid(), self.connection.client.hostname)
        found = _ENGINES.get(key)
        if found is None:
            with _MUTEX:
                found = _ENGINES.get(key)
                if found is None:
                    # Define the table classes before create_all (kombu does the same).
                    _ = self.queue_cls, self.message_cls
                    engine = self._engine_from_config()
                    try:
                        metadata.create_all(engine)
                    except OperationalError:
                        # Another process created the tables at the same moment.
                        metadata.create_all(engine)
                    found = _ENGINES[key] = (engine, sessionmaker(bind=engine))
        return found

    @property
    def engine(self) -> Engine:
        return self._open()[0]

    # --- the queue operations

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        queue_id = self._get_or_create(queue).id
        table = self.message_cls.__table__
        now = _utcnow()
        expired = now - datetime.timedelta(seconds=self.visibility_timeout)
        session = self.session
        try:
            if session.bind.name == "sqlite":
                # Take the write lock before reading, so two workers never lease the same row.
                session.execute(text("BEGIN IMMEDIATE TRANSACTION"))
            row = session.execute(
                select(table.c.id, table.c.payload, table.c.version, table.c.visible)
                .where(table.c.queue_id == queue_id)
                .where(
                    or_(
                        table.c.visible == True,  # noqa: E712  (SQL, not Python)
                        table.c.timestamp < expired,
                        table.c.timestamp.is_(None),
                    )
                )
                .order_by(table.c.id)
                .limit(1)
                .with_for_update(skip_locked=True)
            ).first()
            if row is None:
                session.commit()
                raise Empty()
            version = (row.version or 0) % _VERSION_WRAP + 1
            session.execute(
                update(table)
                .where(table.c.id == row.id)
                .values(visible=False, timestamp=now, version=version)
            )
            session.commit()
        except Empty:
            raise
        except BaseException:
            session.rollback()
            raise
        if not row.visible:
            log.warning("broker.lease_expired", extra={"queue": queue, "row": row.id})
        payload = loads(bytes_to_str(row.payload))
        properties = payload.setdefault("properties", {})
        properties[LEASE_PROPERTY] = [row.id, version]
        # A tag per lease: a row handed out again is a new delivery, not the old one.
        properties["delivery_tag"] = f"{row.id}.{version}"
        if version > 1:
            properties.setdefault("delivery_info", {})["redelivered"] = True
        return payload

    def _forget(self, message: Any) -> None:
        """Acked or dropped: the row goes away."""
        lease = lease_of(message)
        if lease is None:
            return
        table = self.message_cls.__table__
        with self.engine.begin() as conn:
            conn.execute(delete(table).where(table.c.id == lease[0]))

    def _release(self, message: Any) -> None:
        """Back to the queue, unless another worker leased the row since (its lease is newer)."""
        lease = lease_of(message)
        if lease is None or os.getpid() != self._pid:
            # Not ours: a forked child must not hand back what its parent is working on.
            return
        row_id, version = lease
        table = self.message_cls.__table__
        with self.engine.begin() as conn:
            conn.execute(
                update(table)
                .where(table.c.id == row_id, table.c.version == version)
                .values(visible=True, timestamp=_utcnow())
            )

    def _restore(self, message: Any) -> None:
        self._release(message)

    def _restore_at_beginning(self, message: Any) -> None:
        self._release(message)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack=no_ack, **kwargs)
        if message is not None and no_ack:
            self._forget(message)
        return message

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        if no_ack:
            deliver = callback

            def callback(message: Any) -> Any:
                self._forget(message)
                return deliver(message)

        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)


class Transport(kombu_sqlalchemy.Transport):
    """kombu transport ``sqlrelay+<SQLAlchemy URL>``."""

    Channel = Channel


def register() -> None:
    """Make ``sqlrelay+...`` broker URLs resolve to this transport."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES.setdefault(ALIAS, "relay.broker:Transport")
