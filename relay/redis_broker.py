"""kombu's Redis transport with leases: no send is lost to a killed worker or a broker restart.

Why this module exists (and is the ONLY place that touches kombu's private Redis internals,
pinned at kombu 5.7.0, so a kombu upgrade breaks here, loudly, and nowhere else):

1. The pop window. kombu takes a message with BRPOP, which removes it from the queue, and
   only then, in a second round trip (`QoS.append`), records it as unacknowledged. A worker
   killed between the two (or a connection lost between them) loses the message: it is in no
   list and no hash. Here the pop is `BLMOVE queue -> <lease>.transit` (atomic), and the
   bookkeeping round trip also takes it out of the transit list (MULTI), so at every instant
   the message is in the queue, in a transit list, or in the unacknowledged hash.
2. Slow recovery. kombu gives an unacknowledged message back only after `visibility_timeout`
   (an hour: it must exceed the longest countdown a worker holds). Here every consuming
   channel holds a lease (`relay.lease.<owner>`, renewed every few seconds, expiring after
   `lease_seconds`) and indexes what it holds (`<lease>.unacked`). Any worker that finds an
   expired lease gives its transit messages and unacknowledged messages back to their queues
   at once: a killed worker's sends come back within `lease_seconds`, countdowns included.
   Messages a worker holds legitimately (running, prefetched, a retry's countdown) keep a
   live lease and stay with it; `visibility_timeout` remains as a last resort.
3. A crash on reconnect. When the consumer loses its connection, Celery closes the kombu
   connection, which clears the transport's `client`; closing the channel then restores its
   unacknowledged messages through a new connection pool built from `client.hostname`, and
   the worker died with `AttributeError: 'NoneType' object has no attribute 'hostname'`
   (whenever it held unacknowledged messages at that moment). The channel keeps the
   connection parameters it was opened with.

Redis >= 6.2 (BLMOVE). One key per queue (`priority_steps` [0]: the relay sends no
priorities); a channel consuming several queues waits on them in turn. No `global_keyprefix`.
Registered for `redis://` and `rediss://` broker URLs in pushsite/celery.py.
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import socket
import time
import uuid
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

log = logging.getLogger(__name__)

OWNERS_KEY = "relay.lease.owners"
LEASE_PREFIX = "relay.lease."
DEFAULT_LEASE_SECONDS = 15.0
# A transit entry is moved back only if it is still there (two sweepers, one restore).
_RESTORE_TRANSIT_LUA = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  return 1
end
return 0
"""


def lease_key(owner: str) -> str:
    return LEASE_PREFIX + owner


def transit_key(owner: str) -> str:
    return LEASE_PREFIX + owner + ".transit"


def held_key(owner: str) -> str:
    return LEASE_PREFIX + owner + ".unacked"


class QoS(kombu_redis.QoS):
    """kombu's bookkeeping, plus: out of the transit list and into the lease's index in the
    same MULTI; out of the index again on ack, reject and restore."""

    def append(self, message: Any, delivery_tag: str) -> None:
        channel = self.channel
        moved = channel.connection.in_transit.pop(delivery_tag, None)
        delivery = message.delivery_info
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()})
            pipe.hset(
                self.unacked_key,
                delivery_tag,
                dumps([message._raw, delivery["exchange"], delivery["routing_key"]]),
            )
            if channel.owner:
                pipe.hset(held_key(channel.owner), delivery_tag, 1)
            if moved is not None:
                pipe.lrem(moved[0], 1, moved[1])
            pipe.execute()
        virtual.QoS.append(self, message, delivery_tag)

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        pipe = super()._remove_from_indices(delivery_tag, pipe)
        if self.channel.owner:
            pipe = pipe.hdel(held_key(self.channel.owner), delivery_tag)
        return pipe


class Channel(kombu_redis.Channel):
    QoS = QoS
    priority_steps = [0]
    lease_seconds = DEFAULT_LEASE_SECONDS
    # kombu infers its own tuple's exact length; ours is one option longer.
    from_transport_options = (*kombu_redis.Channel.from_transport_options, "lease_seconds")  # type: ignore[assignment]

    owner = ""  # set when the channel first consumes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._connparams_cache: dict[bool, dict[str, Any]] = {}
        self._poll_turn = 0
        self._polled: tuple[str, str] | None = None  # (queue, key) of the pending BLMOVE
        self._lease_renewed = 0.0
        self._pool_client: Any = None
        super().__init__(*args, **kwargs)
        if self.global_keyprefix:
            raise ValueError("relay.redis_broker does not support global_keyprefix")
        # (3) kept for the pools built after the transport's client is gone.
        self._connparams(asynchronous=False)
        self._connparams(asynchronous=True)

    def _create_client(self, asynchronous: bool = False) -> Any:
        """One client per connection pool, not one per call: kombu builds a new client (and
        its response-callback table) for every ack and every bookkeeping pipeline, a cost paid
        per message. A client over a pool is thread-safe, and each
        pipeline taken from it is its own; a new pool (after close) gets a new client."""
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        client = self._pool_client
        if client is None or client.connection_pool is not pool:
            client = self._pool_client = super()._create_client(asynchronous=False)
        return client

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        cached = self._connparams_cache.get(asynchronous)
        if cached is None:
            cached = self._connparams_cache[asynchronous] = super()._connparams(asynchronous)
        return dict(cached)

    # --- the lease

    def _take_lease(self, client: Any = None) -> None:
        """Become an owner (first consume) and renew the lease, at most every second."""
        now = time.monotonic()
        if self.owner and now - self._lease_renewed < 1.0:
            return
        if not self.owner:
            self.owner = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:12]}"
            _warn_if_not_durable(self)
        self.renew_lease(client)

    def renew_lease(self, client: Any = None) -> None:
        if not self.owner or self.closed:
            return
        with self.conn_or_acquire(client) as client:
            pipe = client.pipeline()
            pipe.sadd(OWNERS_KEY, self.owner)
            pipe.set(lease_key(self.owner), 1, px=int(self.lease_seconds * 1000))
            pipe.execute()
        self._lease_renewed = time.monotonic()

    def recover_stranded(self) -> int:
        """Give back this channel's transit messages when no pop is outstanding: a reply lost
        with its connection (kombu disconnects a BRPOP that got no answer in time)."""
        if not self.owner or self._in_poll or self.closed:
            return 0
        with self.conn_or_acquire() as client:
            return _give_back_transit(self, client, self.owner)

    # --- popping into the transit list

    def _brpop_start(self, timeout: float | None = None) -> None:
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        self._take_lease()
        queue = queues[self._poll_turn % len(queues)]
        self._poll_turn += 1
        key = self._q_for_pri(queue, 0)
        self._polled = (queue, key)
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]  # kombu: None
        self.client.connection.send_command(
            "BLMOVE", key, transit_key(self.owner), "RIGHT", "LEFT", timeout or 0
        )

    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                item = self.client.parse_response(self.client.connection, "BLMOVE", **options)
            except self.connection_errors:
                # The message, if one was moved, waits in the transit list.
                self.client.connection.disconnect()
                raise
            if item is None or self._polled is None:
                raise Empty()
            queue, _ = self._polled
            self._queue_cycle.rotate(queue)
            self._deliver_moved(queue, item)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # kombu infers bool
            self._polled = None
            self._flush_brpop_reauth()

    def _deliver_moved(self, queue: str, item: bytes) -> None:
        transit = transit_key(self.owner)
        try:
            payload = loads(bytes_to_str(item))
            tag = payload["properties"]["delivery_tag"]
        except (ValueError, TypeError, KeyError):
            log.error("broker.unreadable_message", extra={"queue": queue})
            with self.conn_or_acquire() as client:
                client.lrem(transit, 1, item)
            return
        self.connection.in_transit[tag] = (transit, item)
        try:
            self.connection._deliver(payload, queue)
        finally:
            # Delivered: `QoS.append` took it out of the transit list. If the delivery failed
            # before that, it stays there for `recover_stranded`.
            self.connection.in_transit.pop(tag, None)

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """basic_get (tests, tools): one LMOVE into the transit list."""
        self._take_lease()
        transit = transit_key(self.owner)
        with self.conn_or_acquire() as client:
            item = client.lmove(self._q_for_pri(queue, 0), transit, "RIGHT", "LEFT")
        if item is None:
            raise Empty()
        payload = loads(bytes_to_str(item))
        self.connection.in_transit[payload["properties"]["delivery_tag"]] = (transit, item)
        return payload

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack=no_ack, **kwargs)
        if message is not None:
            moved = self.connection.in_transit.pop(message.delivery_tag, None)
            if moved is not None:  # no_ack: nothing recorded it, so nothing will remove it
                with self.conn_or_acquire() as client:
                    client.lrem(moved[0], 1, moved[1])
        return message


_durability_checked = False


def _warn_if_not_durable(channel: Channel) -> None:
    """Once per process: a Redis that keeps nothing on disk loses every queued send when it
    restarts, and those were answered `result` (docs/faults.md: run it with appendonly)."""
    global _durability_checked
    if _durability_checked:
        return
    _durability_checked = True
    try:
        with channel.conn_or_acquire() as client:
            found = client.config_get("appendonly")
        appendonly = {bytes_to_str(k): bytes_to_str(v) for k, v in found.items()}.get("appendonly")
    except Exception:  # CONFIG may be disabled (managed Redis): nothing to say then
        return
    if appendonly == "no":
        log.warning("broker.not_durable", extra={"appendonly": appendonly})


def _give_back_transit(channel: Channel, client: Any, owner: str) -> int:
    """Move `owner`'s transit messages back to their queues (each move atomic and once)."""
    transit = transit_key(owner)
    restore = client.register_script(_RESTORE_TRANSIT_LUA)
    moved = 0
    for item in client.lrange(transit, 0, -1):
        try:
            payload = loads(bytes_to_str(item))
            info = payload["properties"]["delivery_info"]
            queues = channel._lookup(info["exchange"], info["routing_key"])
        except (ValueError, TypeError, KeyError):
            log.error("broker.unreadable_message", extra={"owner": owner})
            client.lrem(transit, 1, item)
            continue
        payload["headers"]["redelivered"] = True
        for queue in queues:
            moved += restore(
                keys=[transit, channel._q_for_pri(queue, 0)], args=[item, dumps(payload)]
            )
    return moved


def _expire(channel: Channel, client: Any, owner: str) -> tuple[int, int]:
    """Give back what a dead owner held: its transit messages, then its unacknowledged ones
    (kombu's own restore, a transaction per message: a message acked meanwhile is skipped)."""
    transit = _give_back_transit(channel, client, owner)
    held = [bytes_to_str(tag) for tag in client.hkeys(held_key(owner))]
    for tag in held:
        channel.qos.restore_by_tag(tag, client)
    pipe = client.pipeline()
    pipe.delete(held_key(owner), transit_key(owner))
    pipe.srem(OWNERS_KEY, owner)
    pipe.execute()
    return transit, len(held)


def sweep(channel: Channel) -> int:
    """Find owners whose lease expired and give back what they held; returns how many."""
    with channel.conn_or_acquire() as client:
        owners = [bytes_to_str(owner) for owner in client.smembers(OWNERS_KEY)]
        if not owners:
            return 0
        pipe = client.pipeline()
        for owner in owners:
            pipe.exists(lease_key(owner))
        alive = pipe.execute()
        dead = [owner for owner, live in zip(owners, alive, strict=True) if not live]
        for owner in dead:
            transit, held = _expire(channel, client, owner)
            log.warning(
                "broker.lease_expired",
                extra={"owner": owner, "in_transit": transit, "unacknowledged": held},
            )
        return len(dead)


class Transport(kombu_redis.Transport):
    Channel = Channel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # delivery tag -> (transit list, raw item) while a moved message is being delivered
        self.in_transit: dict[str, tuple[str, bytes]] = {}

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        cycle: Any = self.cycle
        old = getattr(cycle, "_relay_lease_tref", None)
        if old is not None:
            old.cancel()
        lease = float(
            connection.client.transport_options.get("lease_seconds", DEFAULT_LEASE_SECONDS)
        )
        cycle._relay_lease_tref = loop.call_repeatedly(
            max(0.5, lease / 5), lambda: self.tend_leases()
        )

    def tend_leases(self) -> None:
        """Every few seconds on the event loop: renew our leases, give back stranded transit
        messages, expire dead owners' leases. Broker trouble waits for the next round."""
        cycle: Any = self.cycle
        channels = [channel for channel in list(cycle._channels) if channel.owner]
        try:
            for channel in channels:
                channel.renew_lease()
                channel.recover_stranded()
            if channels:
                sweep(channels[0])
        except self.connection_errors:
            log.debug("broker.lease_tending_failed", exc_info=True)
        except Exception:  # never let bookkeeping take the worker's event loop down
            log.exception("broker.lease_tending_crashed")


def register() -> None:
    """Make `redis://` and `rediss://` broker URLs use this transport (pushsite/celery.py)."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES["redis"] = "relay.redis_broker:Transport"
    TRANSPORT_ALIASES["rediss"] = "relay.redis_broker:Transport"


# --- Publishing without a kombu producer (the gateway's hot path)

# Celery's message protocol 2 (docs.celeryq.dev, "Message Protocol"): the body is
# [args, kwargs, embed]; the relay's tasks take positional JSON arguments and nothing else.
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
DEFAULT_QUEUE = "celery"


class TaskPublisher:
    """Writes a Celery task message straight into its Redis queue, byte-compatible with what
    `send_task` and this transport's `_put` write (tests/test_redis_publisher.py compares them).

    Why: `send_task` builds a signature, acquires a producer, declares, and kombu builds a Redis
    client per message, a large part of the gateway's CPU per publish. This is one LPUSH
    on a pooled client. It keeps Celery's publish retry policy (a few quick attempts, then the
    error, so the gateway answers `wait` instead of stalling) and the default queue only: a
    routed or prioritised send still goes through `send_task`.
    """

    def __init__(
        self,
        url: str,
        *,
        transport_options: dict[str, Any],
        retry_policy: dict[str, Any],
        queue: str = DEFAULT_QUEUE,
    ) -> None:
        import redis

        self._client = redis.Redis.from_url(
            url,
            socket_timeout=transport_options.get("socket_timeout"),
            socket_connect_timeout=transport_options.get("socket_connect_timeout"),
            health_check_interval=int(transport_options.get("health_check_interval", 25)),
        )
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._queue = queue
        self._origin = f"gen{os.getpid()}@{socket.gethostname()}"
        retries = int(retry_policy.get("max_retries", 0) or 0)
        start = float(retry_policy.get("interval_start", 0))
        step = float(retry_policy.get("interval_step", 0.2))
        most = float(retry_policy.get("interval_max", 1.0))
        self._pauses = [min(most, start + step * attempt) for attempt in range(retries)]

    def message(self, task: str, args: list[Any], *, countdown: float | None = None) -> str:
        """The JSON text kombu's Redis transport keeps in the queue for this task call."""
        task_id = str(uuid.uuid4())
        eta = None
        if countdown is not None:
            eta = (
                datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=countdown)
            ).isoformat()
        body = base64.b64encode(json.dumps([args, {}, _EMBED]).encode()).decode("ascii")
        return json.dumps(
            {
                "body": body,
                "content-encoding": "utf-8",
                "content-type": "application/json",
                "headers": {
                    "lang": "py",
                    "task": task,
                    "id": task_id,
                    "shadow": None,
                    "eta": eta,
                    "expires": None,
                    "group": None,
                    "group_index": None,
                    "retries": 0,
                    "timelimit": [None, None],
                    "root_id": task_id,
                    "parent_id": None,
                    "argsrepr": "",
                    "kwargsrepr": "",
                    "origin": self._origin,
                    "ignore_result": None,
                    "replaced_task_nesting": 0,
                    "stamped_headers": None,
                    "stamps": {},
                },
                "properties": {
                    "correlation_id": task_id,
                    "reply_to": "",
                    "delivery_mode": 2,
                    "delivery_info": {"exchange": "", "routing_key": self._queue},
                    "priority": 0,
                    "body_encoding": "base64",
                    "delivery_tag": str(uuid.uuid4()),
                },
            }
        )

    def publish(self, task: str, args: list[Any], *, countdown: float | None = None) -> None:
        """Queue one task call; returns once Redis has it, raises the last error if it will not
        take it within the retry policy."""
        payload = self.message(task, args, countdown=countdown)
        for pause in [*self._pauses, None]:
            try:
                self._client.lpush(self._queue, payload)
                return
            except self._errors:
                if pause is None:
                    raise
                time.sleep(pause)

    def close(self) -> None:
        self._client.close()
