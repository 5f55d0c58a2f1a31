"""The UnifiedPush push resource's POST, as plain HTTP: one function both the Django view and
the WSGI fast path call, so the two cannot answer differently.

Why a fast path at all: a POST is the hot path (an application server may send thousands a
second), and Django's request cycle (middleware, request and response objects, URL
resolution) cost about as much CPU as everything the POST itself does. `FastPushPath` wraps
the WSGI application (pushsite/wsgi.py) and answers `POST /push/v4.local.…` directly; every
other request, including GET and DELETE on endpoints, goes through Django as usual.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from django.db import close_old_connections

from relay.unifiedpush.services import messages
from relay.unifiedpush.services.channel import AsyncChannels
from relay.unifiedpush.services.messages import MAX_BODY_BYTES, PushRefused

log = logging.getLogger(__name__)

Answer = tuple[int, list[tuple[str, str]], bytes]
REASONS = {
    201: "Created",
    400: "Bad Request",
    404: "Not Found",
    411: "Length Required",
    413: "Content Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
# What Django's security middleware would add; an endpoint answer carries no markup anyway.
SECURITY_HEADERS = [("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "same-origin")]
CRASHED: Answer = (500, [("Content-Type", "application/json")], b"{}")
# What a header may be on the wire (RFC 9110: a token; visible ASCII, spaces and tabs).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[ \t\x21-\x7e]*")


def crashed(error: BaseException) -> Answer:
    """The 500 answer to a POST that failed unexpectedly, logged without details."""
    log.error(
        "unifiedpush.post_crashed", exc_info=error, extra={"error_type": type(error).__name__}
    )
    return CRASHED


def sendable(answer: Answer) -> Answer:
    """`answer`, or the 500 answer if a header could not be written as it is: whatever was
    computed, the client gets an answer (a server refuses to send such a header and would
    close the connection, or leave it waiting, without one)."""
    for name, value in answer[1]:
        if not (_HEADER_NAME.fullmatch(name) and _HEADER_VALUE.fullmatch(value)):
            return crashed(ValueError(f"the {name} header cannot be sent"))
    return answer


def refused(refusal: PushRefused) -> Answer:
    headers = [("Content-Type", "application/json")]
    if refusal.retry_after is not None:
        headers.append(("Retry-After", str(refusal.retry_after)))
    return refusal.status, headers, json.dumps({"error": refusal.reason}).encode()


def post(
    *,
    token: str,
    content_length: str,
    transfer_encoding: str,
    read: Callable[[int], bytes],
    header: Callable[[str], str | None],
) -> Answer:
    """Answer a POST to an endpoint: 201 with Location and TTL, or the refusal's status."""
    length = int(content_length) if content_length.isdigit() else None
    if length is None and "chunked" in transfer_encoding.lower():
        return 411, [("Content-Type", "application/json")], b'{"error": "send a Content-Length"}'
    try:
        messages.check_length(length)
        accepted = messages.accept(
            token=token,
            body=read(MAX_BODY_BYTES + 1) if length else b"",
            ttl=header("TTL"),
            topic=header("Topic"),
            urgency=header("Urgency"),
        )
    except PushRefused as refusal:
        return refused(refusal)
    return created(accepted)


def created(accepted: messages.Accepted) -> Answer:
    return (
        201,
        [("Location", accepted.location), ("TTL", str(accepted.ttl)),
         ("Urgency", accepted.urgency)],
        b"",
    )  # fmt: skip


class FastPushPath:
    """WSGI middleware: POSTs to endpoints skip Django's request cycle (see the module)."""

    PREFIX = "/push/v4.local."

    def __init__(self, application: Callable[..., Iterable[bytes]]) -> None:
        self.application = application

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") != "POST" or not path.startswith(self.PREFIX):
            return self.application(environ, start_response)
        try:
            answer = post(
                token=path[len("/push/") :],
                content_length=environ.get("CONTENT_LENGTH") or "",
                transfer_encoding=environ.get("HTTP_TRANSFER_ENCODING", ""),
                read=environ["wsgi.input"].read,
                header=lambda name: environ.get("HTTP_" + name.upper()),
            )
        except Exception as error:  # what Django would turn into a 500
            answer = crashed(error)
        status, headers, body = sendable(answer)
        if status >= 500:
            # What Django does at the end of every request, needed here only after a failure:
            # a connection the database dropped is closed, and the next POST opens a new one.
            close_old_connections()
        start_response(
            f"{status} {REASONS.get(status, '')}",
            [*headers, *SECURITY_HEADERS, ("Content-Length", str(len(body)))],
        )
        return [body]


async def post_in_loop(
    *,
    token: str,
    body: bytes,
    header: Callable[[str], str | None],
    channels: AsyncChannels,
    in_thread: Callable[[Callable[[], Answer]], Awaitable[Answer]],
) -> Answer:
    """`post` for an event loop (pushsite/web_worker.py), with the same answers: nothing here
    waits for the database; what would (a cold cache, storing the message) runs `in_thread`."""

    def sync() -> Answer:
        return post(
            token=token,
            content_length=str(len(body)),
            transfer_encoding="",
            read=lambda size: body[:size],
            header=header,
        )

    try:
        messages.check_length(len(body))
        prepared = messages.prepare(
            token=token,
            body=body,
            ttl=header("TTL"),
            topic=header("Topic"),
            urgency=header("Urgency"),
            cached_only=True,
        )
    except PushRefused as refusal:
        return refused(refusal)
    except messages.ColdCache:
        return await in_thread(sync)
    address = messages.direct_address(prepared)
    handover = await channels.offer(address, prepared.message) if address else None
    try:
        accepted = messages.settled_at_once(prepared, handover)
    except PushRefused as refusal:
        return refused(refusal)
    if accepted is not None:
        return created(accepted)

    def store() -> Answer:
        try:
            return created(messages.settle(prepared, None))
        except PushRefused as refusal:
            return refused(refusal)

    return await in_thread(store)
