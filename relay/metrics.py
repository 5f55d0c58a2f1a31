"""Every Prometheus metric of the relay, in one place (docs/production.md, "Watching it").

The services count what they do through the helpers below; the web process serves them at
/metrics, the gateway and the worker on their probe listener (relay/probes.py). Django-free
and cheap to call on hot paths.

Labels never carry a JID, a token, a node, a secret or an endpoint: only tenant and app ids
or names, provider names (fcm, apns, wns), verdicts, outcomes and bounded reason kinds.

The web process runs several workers: with PROMETHEUS_MULTIPROC_DIR set (pushsite/server.py
sets it before the workers start), prometheus_client keeps each process's values in files
there, and /metrics adds up those of every worker (`registry()`). The gateway and the worker
are one process each and use the default registry.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: provider answers take milliseconds to the provider timeout (5 s by default); a push
# waits from its publish to its delivery for up to SEND_MAX_AGE_SECONDS (retries).
SEND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PUSH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# --- gateway: publishes and registrations -------------------------------------------------------
PUBLISHES = Counter(
    "relay_publishes",
    "XEP-0357 publishes answered, by verdict (tenant: id; empty for an unknown node).",
    ["tenant", "verdict"],
)
REGISTRATIONS = Counter(
    "relay_registration_requests",
    "Register and unregister commands, by result (created, renewed, refused, unregistered).",
    ["tenant", "result"],
)
LINK_UP = Gauge(
    "relay_gateway_link_up",
    "1 while the gateway's XEP-0114 link of a component is up, 0 while it is down.",
    ["component", "app"],
    multiprocess_mode="livemax",
)

# --- worker: sends ------------------------------------------------------------------------------
SENDS = Counter(
    "relay_sends",
    "Final outcomes of sends (delivered, dead-token, failed) and retries scheduled "
    "(retry-later), by provider.",
    ["provider", "outcome"],
)
SEND_DURATION = Histogram(
    "relay_send_duration_seconds",
    "How long a provider took to answer one group of wake-ups (one app, one provider).",
    ["provider"],
    buckets=SEND_BUCKETS,
)
PUSH_LATENCY = Histogram(
    "relay_push_latency_seconds",
    "From the publish (or the dead letter's replay) to the provider's acceptance.",
    ["provider"],
    buckets=PUSH_BUCKETS,
)
RETRIES = Counter(
    "relay_send_retries",
    "Sends queued again for later, by provider and kind (busy, stalled, quota, error).",
    ["provider", "kind"],
)
DEAD_LETTERS = Counter(
    "relay_dead_letters",
    "Pushes given up (dead letters), by provider and kind (exhausted, too-old, not-requeued, "
    "failed).",
    ["provider", "kind"],
)
DEAD_LETTERS_REPLAYED = Counter("relay_dead_letters_replayed", "Dead letters queued again.")
DEFERRED = Counter(
    "relay_deferred_sends_written",
    "Sends deferred to the database for later (retries, rate limits, coalescing windows).",
)
DEFERRED_PUBLISHED = Counter(
    "relay_deferred_sends_published",
    "Deferred sends the sweep published to the broker once due (a sweep that crashed after "
    "publishing publishes its rows again: at least once).",
)
DEFERRED_SWEEPS_HELD = Counter(
    "relay_deferred_sweeps_held",
    "Sweeps of deferred sends that published nothing because fresh pushes filled the send "
    "queue (RELAY_DEFERRED_QUEUE_LIMIT).",
)
DEFERRED_SWEEP_FAILURES = Counter(
    "relay_deferred_sweep_failures",
    "Sweeps of deferred sends that published nothing because the broker refused (rows kept).",
)
JOURNAL_WAITING = Gauge(
    "relay_delivery_journal_waiting",
    "Pushes the gateway sent whose Delivery rows are in its journal, not yet in the database.",
    multiprocess_mode="livesum",
)
JOURNAL_RECOVERED = Counter(
    "relay_delivery_journal_recovered",
    "Journals of gateways that were gone, written to the database by this one.",
)
JOURNAL_REFUSED = Counter(
    "relay_delivery_journal_refused",
    "Journals whose rows the database refused, set aside as *.refused files for an operator.",
)
IN_FLIGHT = Gauge(
    "relay_sends_in_flight",
    "Wake-ups being sent right now, by provider (waiting for a slot or for the provider).",
    ["provider"],
    multiprocess_mode="livesum",
)

# --- web ----------------------------------------------------------------------------------------
HTTP_REQUESTS = Counter(
    "relay_http_requests",
    "HTTP requests answered by the web process, by handler (api, push, matrix, admin, probe, "
    "static, other), method and status.",
    ["handler", "method", "status"],
)
HTTP_DURATION = Histogram(
    "relay_http_request_duration_seconds",
    "How long the web process took to answer, by handler.",
    ["handler"],
    buckets=HTTP_BUCKETS,
)

# Names of the gauges computed at scrape time from the database and the broker
# (relay/services/observability.py): defined there as metric families, listed here for the
# dashboard and the tests.
STATE_GAUGES = (
    "relay_registrations",
    "relay_credential_expiry_seconds",
    "relay_dead_letters_pending",
    "relay_queue_depth",
    "relay_deferred_sends",
    "relay_deferred_oldest_due_seconds",
    "relay_state_up",
)


def count_publishes(verdicts: Iterable[tuple[str, str]]) -> None:
    """One increment per (tenant, verdict) pair of a batch."""
    tally: dict[tuple[str, str], int] = {}
    for key in verdicts:
        tally[key] = tally.get(key, 0) + 1
    for (tenant, verdict), count in tally.items():
        PUBLISHES.labels(tenant, verdict).inc(count)


def retry_kind(code: str, *, busy: bool, quota: bool) -> str:
    if busy:
        return "busy"
    if code == "PROVIDER_STALLED":
        return "stalled"
    return "quota" if quota else "error"


def dead_letter_kind(reason: str) -> str:
    """The bounded kind of a dead letter's reason ("retries exhausted: HTTP_500" -> exhausted)."""
    for prefix, kind in (
        ("retries exhausted", "exhausted"),
        ("too old", "too-old"),
        ("not re-queued", "not-requeued"),
    ):
        if reason.startswith(prefix):
            return kind
    return "failed"


@contextmanager
def sending(provider: str, count: int) -> Iterator[None]:
    """Count `count` wake-ups in flight to `provider` and time their answer."""
    gauge = IN_FLIGHT.labels(provider)
    gauge.inc(count)
    start = time.perf_counter()
    try:
        yield
    finally:
        gauge.dec(count)
        SEND_DURATION.labels(provider).observe(time.perf_counter() - start)


def set_link(component_id: int, app: str, up: bool | None) -> None:
    """The link's state; None forgets it (the component was removed or disabled)."""
    if up is None:
        with suppress(KeyError):
            LINK_UP.remove(str(component_id), app)
        return
    LINK_UP.labels(str(component_id), app).set(1 if up else 0)


def http_handler(path: str) -> str:
    """A bounded name for what a path reaches; never the path itself (it may hold a token)."""
    if path.startswith("/api/"):
        return "api"
    if path.startswith("/push/"):
        return "push"
    if path.startswith("/_matrix/"):
        return "matrix"
    if path.startswith("/admin/"):
        return "admin"
    if path in ("/healthz", "/readyz", "/metrics"):
        return "probe"
    if path.startswith("/static/"):
        return "static"
    return "other"


class StateCollector(Collector):
    """Gauges read at scrape time (from the database and the broker) by `read`."""

    def __init__(self, read: Callable[[], list[Metric]]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        return self.read()

    def describe(self) -> Iterable[Metric]:
        return []  # never called at registration time: `read` needs the database


# Set by pushsite/server.py for the web's workers only (from WEB_METRICS_DIR), never in the
# shared environment.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str:
    return os.environ.get(MULTIPROC_ENV, "")


def registry(*extra: Collector) -> CollectorRegistry:
    """What a scrape of this process shows: in multiprocess mode every process's values from
    the files (the web's workers), else this process's; plus `extra` collectors."""
    if multiprocess_dir():
        from prometheus_client import multiprocess

        scraped = CollectorRegistry(auto_describe=False)
        multiprocess.MultiProcessCollector(scraped)
    elif not extra:
        return REGISTRY
    else:
        scraped = CollectorRegistry(auto_describe=False)
        scraped.register(_Default())
    for collector in extra:
        scraped.register(collector)
    return scraped


class _Default(Collector):
    """The default registry's metrics inside another registry."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()

    def describe(self) -> Iterable[Metric]:
        return []


def render(scraped: CollectorRegistry) -> bytes:
    return generate_latest(scraped)


def token_accepted(expected: str, authorization: str) -> bool:
    """Whether a scrape may read /metrics: always without METRICS_TOKEN, else only with
    `Authorization: Bearer <METRICS_TOKEN>` (tenant and app names are no one else's business)."""
    if not expected:
        return True
    return hmac.compare_digest(authorization.encode(), f"Bearer {expected}".encode())


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def count_request(path: str, method: str, status: int, seconds: float) -> None:
    """One answered request of the web process (pushsite/server.py counts every one, of
    every route), by handler, method and status; never the path itself."""
    handler = http_handler(path)
    HTTP_REQUESTS.labels(handler, method if method in _METHODS else "other", str(status)).inc()
    HTTP_DURATION.labels(handler).observe(seconds)
