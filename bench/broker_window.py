"""How wide is the pop window of kombu's Redis transport, and so how often does a SIGKILL lose
the send being handed to a worker? Prints the figures and writes bench/results/broker_window.json.

kombu's BRPOP removes a message from the queue; only the next round trip (`QoS.append`)
records it as unacknowledged. Until then it exists only in the worker's socket buffer and
memory. This consumer times, per message, publish -> recorded (the pop happens at the publish:
the consumer waits in BRPOP) with kombu's transport, at a steady rate, idle and with a second
thread keeping the GIL busy as a loaded worker's task threads do. The share of time during
which some message is inside the window (rate x mean window) is the chance that a worker
killed at a random instant loses one. relay/redis_broker.py has no such window: BLMOVE puts
the message in a transit list in the same step that takes it from the queue (measured here
too, as time in the transit list; its exposure is 0 by construction).

Needs a Redis: CELERY_BROKER_URL (make bench starts a private one), db 14 is used.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.transport import redis as kombu_redis

from bench.common import percentiles, write_results
from relay import redis_broker

QUEUE = "broker-window"


def burn(stop: threading.Event) -> None:
    """Pure-Python work in another thread: the GIL contention of busy task threads."""
    while not stop.is_set():
        sum(i * i for i in range(2000))


def measure(url: str, transport: str, rate: float, count: int, busy: bool) -> dict[str, Any]:
    recorded: dict[str, float] = {}
    read: dict[str, float] = {}
    leased = transport.startswith("relay")
    qos_class = redis_broker.QoS if leased else kombu_redis.QoS
    channel_class = redis_broker.Channel if leased else kombu_redis.Channel
    original = qos_class.append
    original_read = channel_class._brpop_read
    reading = threading.local()

    def timed_read(self: Any, **options: Any) -> Any:
        reading.at = time.time()  # the pop's reply is being read (it may have waited)
        return original_read(self, **options)

    def timed_append(self: Any, message: Any, delivery_tag: str) -> None:
        original(self, message, delivery_tag)
        recorded[message.payload["id"]] = time.time()
        read[message.payload["id"]] = getattr(reading, "at", recorded[message.payload["id"]])

    qos_class.append = timed_append  # type: ignore[method-assign]
    channel_class._brpop_read = timed_read  # type: ignore[method-assign]
    stop = threading.Event()
    burner = threading.Thread(target=burn, args=(stop,), daemon=True)
    published: dict[str, float] = {}
    queue = Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE)
    try:
        with (
            Connection(url, transport=transport) as consumer_conn,
            Connection(url) as producer_conn,
        ):
            queue(consumer_conn.default_channel).declare()
            queue(consumer_conn.default_channel).purge()
            done = threading.Event()

            def on_message(body: dict[str, Any], message: Any) -> None:
                message.ack()
                if len(recorded) >= count:
                    done.set()

            with Consumer(consumer_conn, [queue], callbacks=[on_message], accept=["json"]):
                if busy:
                    burner.start()

                def produce() -> None:
                    producer = Producer(producer_conn)
                    start = time.monotonic()
                    for n in range(count):
                        delay = start + n / rate - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)
                        key = f"m{n}"
                        published[key] = time.time()
                        producer.publish(
                            {"id": key}, exchange=queue.exchange, routing_key=QUEUE, declare=[queue]
                        )

                threading.Thread(target=produce, daemon=True).start()
                deadline = time.monotonic() + count / rate + 30
                while not done.is_set() and time.monotonic() < deadline:
                    with contextlib.suppress(TimeoutError):
                        consumer_conn.drain_events(timeout=1)
    finally:
        stop.set()
        qos_class.append = original  # type: ignore[method-assign]
        channel_class._brpop_read = original_read  # type: ignore[method-assign]
    keys = [key for key in recorded if key in published]
    # The pop happened between the publish and the reply being read: the window lies between.
    upper = [recorded[key] - published[key] for key in keys]
    lower = [recorded[key] - read[key] for key in keys]

    def chance(windows: list[float]) -> float:
        """The share of time some message exists only in the consumer's memory."""
        if leased or not windows:
            return 0.0
        return round(min(1.0, rate * sum(windows) / len(windows)), 4)

    return {
        "transport": transport,
        "busy_gil": busy,
        "rate_per_second": rate,
        "messages": len(keys),
        "window_at_least_ms": percentiles(lower),
        "window_at_most_ms": percentiles(upper),
        "loss_chance_per_kill": [chance(lower), chance(upper)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=600)
    args = parser.parse_args()
    base = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
    if not base.startswith("redis://"):
        sys.exit("needs CELERY_BROKER_URL=redis://...")
    url = base.rsplit("/", 1)[0] + "/14"
    runs = []
    for transport in ("kombu.transport.redis:Transport", "relay.redis_broker:Transport"):
        for rate, busy in ((40.0, False), (40.0, True), (200.0, False)):
            result = measure(url, transport, rate, args.count, busy)
            runs.append(result)
            low, high = result["window_at_least_ms"], result["window_at_most_ms"]
            chances = result["loss_chance_per_kill"]
            print(
                f"{transport.split(':')[0]:22} {rate:4.0f}/s busy GIL={busy!s:5} "
                f"pop->recorded p50 {low['p50']}..{high['p50']} ms, mean {low['mean']}.."
                f"{high['mean']} ms; a SIGKILL at a random instant loses a message with chance "
                f"{chances[0]:.3f}..{chances[1]:.3f}",
                flush=True,
            )
    write_results(
        "broker_window",
        {
            "machine": {
                "cpus": os.cpu_count(),
                "load": os.getloadavg(),
                "python": platform.python_version(),
            },
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
