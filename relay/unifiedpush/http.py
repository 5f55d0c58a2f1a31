"""The UnifiedPush HTTP resource, its one implementation: the push resource (RFC 8030 / the
UnifiedPush server spec: POST and GET on `/push/<token>`, DELETE on `/push/message/<ref>`) and
the Matrix push gateway (`/_matrix/push/v1/notify`). The rules live in
`relay.unifiedpush.services`.

Served on the web server's event loop (pushsite/server.py), not by Django: a POST for a phone
that is online waits for the phone's answer (the direct path), and on the loop that wait
holds no thread. What may wait for the database (a component's state not cached, storing a
message, GET, DELETE, the Matrix gateway) runs on the server's thread pool (`in_thread`).
The server adds the security headers, counts the request and writes the access log line.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from django.core import signals

from relay import conf
from relay.unifiedpush.services import matrix, messages
from relay.unifiedpush.services.channel import AsyncChannels
from relay.unifiedpush.services.messages import MAX_BODY_BYTES, PushRefused

log = logging.getLogger(__name__)

T = TypeVar("T")
Answer = tuple[int, list[tuple[str, str]], bytes]
Header = Callable[[str], str | None]
# Runs a blocking function on the web server's thread pool.
InThread = Callable[[Callable[[], Any]], Awaitable[Any]]

# The resource's paths, percent-decoded (as Django's URLs matched them): anything else under
# /push/ (an empty or nested name) is Django's 404.
PATHS = re.compile(r"/push/(?:message/)?[^/]+|/_matrix/push/v1/notify")
MESSAGE_PREFIX = "/push/message/"
MATRIX_PATH = "/_matrix/push/v1/notify"
DISCOVERY = b'{"unifiedpush": {"version": 1}}'
MATRIX_DISCOVERY = b'{"unifiedpush": {"gateway": "matrix"}}'
JSON = ("Content-Type", "application/json")
CRASHED: Answer = (500, [JSON], b"{}")
# What a header may be on the wire (RFC 9110: a token; visible ASCII, spaces and tabs).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[ \t\x21-\x7e]*")


def crashed(error: BaseException) -> Answer:
    """The 500 answer to a request that failed unexpectedly, logged without details."""
    log.error(
        "unifiedpush.post_crashed", exc_info=error, extra={"error_type": type(error).__name__}
    )
    return CRASHED


def sendable(answer: Answer) -> Answer:
    """`answer`, or the 500 answer if a header could not be written as it is: whatever was
    computed, the client gets an answer."""
    for name, value in answer[1]:
        if not (_HEADER_NAME.fullmatch(name) and _HEADER_VALUE.fullmatch(value)):
            return crashed(ValueError(f"the {name} header cannot be sent"))
    return answer


def _json(status: int, document: object, *extra: tuple[str, str]) -> Answer:
    return status, [JSON, *extra], json.dumps(document).encode()


def _retry_after(refusal: PushRefused) -> tuple[tuple[str, str], ...]:
    return () if refusal.retry_after is None else (("Retry-After", str(refusal.retry_after)),)


def refused(refusal: PushRefused) -> Answer:
    return _json(refusal.status, {"error": refusal.reason}, *_retry_after(refusal))


def _not_allowed(*allowed: str) -> Answer:
    return _json(405, {"error": "method not allowed"}, ("Allow", ", ".join(allowed)))


def created(accepted: messages.Accepted) -> Answer:
    return (
        201,
        [("Location", accepted.location), ("TTL", str(accepted.ttl)),
         ("Urgency", accepted.urgency)],
        b"",
    )  # fmt: skip


def _in_thread(work: Callable[[], T]) -> Callable[[], T]:
    """`work` as the pool runs it, between the signals Django sends around each of its
    requests: a database connection that broke or outlived CONN_MAX_AGE is closed, and the
    thread's next job opens a new one."""

    def run() -> T:
        signals.request_started.send(sender=PushResource)
        try:
            return work()
        finally:
            signals.request_finished.send(sender=PushResource)

    return run


class PushResource:
    """What the web server calls for the paths in `PATHS` (one instance per process: it
    keeps the process's connections to the gateways)."""

    paths = PATHS
    # What is kept of a request body; a longer one is read and dropped, and refused by
    # `refusal` from its Content-Length (or, chunked, its size).
    max_body_bytes = max(MAX_BODY_BYTES, matrix.MAX_REQUEST_BYTES) + 1

    def __init__(self) -> None:
        self.channels = AsyncChannels(window=conf.current().unifiedpush_direct_seconds)

    async def aclose(self) -> None:
        """Closes its connections to the gateways: for a caller whose event loop ends (the
        web server's lives as long as its process)."""
        await self.channels.aclose()

    def refusal(self, method: str, path: str, header: Header) -> Answer | None:
        """The answer from the head alone, before the body is read (it is then dropped)."""
        if method != "POST":
            return None
        length_text = header("Content-Length")
        length = int(length_text) if length_text and length_text.isdigit() else None
        if path == MATRIX_PATH:
            if length is not None and length > matrix.MAX_REQUEST_BYTES:
                return _json(413, {"errcode": "M_TOO_LARGE", "error": "request too large"})
            return None
        if path.startswith(MESSAGE_PREFIX):
            return None
        if length is None and "chunked" in (header("Transfer-Encoding") or "").lower():
            return _json(411, {"error": "send a Content-Length"})
        try:
            messages.check_length(length)
        except PushRefused as refusal:
            return refused(refusal)
        return None

    async def answer(
        self, method: str, path: str, header: Header, body: bytes, in_thread: InThread
    ) -> Answer:
        """The answer to a request whose body was read; never raises."""
        try:
            return sendable(await self._answer(method, path, header, body, in_thread))
        except Exception as error:  # what Django would turn into a 500
            return crashed(error)

    async def _answer(
        self, method: str, path: str, header: Header, body: bytes, in_thread: InThread
    ) -> Answer:
        if path == MATRIX_PATH:
            if method == "GET":
                return 200, [JSON], MATRIX_DISCOVERY
            if method != "POST":
                return _not_allowed("GET", "POST")
            return await in_thread(_in_thread(lambda: _matrix(body)))
        if path.startswith(MESSAGE_PREFIX):
            if method != "DELETE":
                return _not_allowed("DELETE")
            reference = path[len(MESSAGE_PREFIX) :]
            return await in_thread(_in_thread(lambda: _withdraw(reference)))
        token = path[len("/push/") :]
        if method == "POST":
            return await self._post(token, body, header, in_thread)
        if method in ("GET", "HEAD"):
            return await in_thread(_in_thread(lambda: _discover(token)))
        return _not_allowed("GET", "POST")

    async def _post(self, token: str, body: bytes, header: Header, in_thread: InThread) -> Answer:
        """Deliver or store one message: 201 with Location and TTL, or the refusal's status.
        Nothing on the loop waits for the database."""

        def prepare(cached_only: bool) -> messages.Prepared:
            return messages.prepare(
                token=token,
                body=body,
                ttl=header("TTL"),
                topic=header("Topic"),
                urgency=header("Urgency"),
                cached_only=cached_only,
            )

        try:
            try:
                prepared = prepare(cached_only=True)
            except messages.ColdCache:
                prepared = await in_thread(_in_thread(lambda: prepare(cached_only=False)))
            address = messages.direct_address(prepared)
            handover = await self.channels.offer(address, prepared.message) if address else None
            accepted = messages.settled_at_once(prepared, handover)
            if accepted is None:
                accepted = await in_thread(_in_thread(lambda: messages.settle(prepared, None)))
        except PushRefused as refusal:
            return refused(refusal)
        return created(accepted)


def _discover(token: str) -> Answer:
    try:
        messages.discover(token=token)
    except PushRefused as refusal:
        return refused(refusal)
    return 200, [JSON], DISCOVERY


def _withdraw(reference: str) -> Answer:
    try:
        messages.withdraw(reference=reference)
    except PushRefused as refusal:
        return refused(refusal)
    return 204, [], b""


def _matrix(body: bytes) -> Answer:
    if len(body) > matrix.MAX_REQUEST_BYTES:  # chunked, without a Content-Length
        return _json(413, {"errcode": "M_TOO_LARGE", "error": "request too large"})
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return _json(400, {"errcode": "M_NOT_JSON", "error": "not JSON"})
    except RecursionError:  # nested deeper than the interpreter's stack (`[` * 100000)
        return _json(400, {"errcode": "M_BAD_JSON", "error": "nested too deeply"})
    try:
        rejected = matrix.notify(document)
    except matrix.BadNotification as bad:
        return _json(400, {"errcode": "M_BAD_JSON", "error": str(bad)})
    except PushRefused as refusal:
        error = {"errcode": "M_LIMIT_EXCEEDED", "error": refusal.reason}
        return _json(refusal.status, error, *_retry_after(refusal))
    return _json(200, {"rejected": rejected})
