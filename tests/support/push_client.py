"""The UnifiedPush resource called in the test's own thread, as Django's test client calls
views: the same answers the web server sends (its routing, the resource's refusal from the
head, then its answer), with the database work on the test's connection (its transaction).

The real server over real sockets: tests/test_web_server.py and the end-to-end tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from asgiref.sync import async_to_sync, sync_to_async
from django.core import signals
from django.db import close_old_connections

from relay.unifiedpush import http as unifiedpush_http


class PushResponse:
    """What the tests read of an answer, as of a Django test response."""

    def __init__(self, status: int, headers: list[tuple[str, str]], content: bytes) -> None:
        self.status_code = status
        self.headers = {name.lower(): value for name, value in headers}
        self.content = content

    def __getitem__(self, name: str) -> str:
        return self.headers[name.lower()]

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)

    def json(self) -> Any:
        return json.loads(self.content)


class PushClient:
    """`post`, `get`, `delete` and `generic` as Django's test client takes them."""

    def generic(
        self,
        method: str,
        path: str,
        data: bytes | str | dict[str, Any] = b"",
        content_type: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: str,
    ) -> PushResponse:
        if isinstance(data, dict):
            data = json.dumps(data)
        body = data.encode() if isinstance(data, str) else data
        fields = {name.lower(): value for name, value in (headers or {}).items()}
        for key, value in extra.items():  # HTTP_TTL="60", as Django's client takes them
            fields[key.removeprefix("HTTP_").replace("_", "-").lower()] = value
        if content_type:
            fields.setdefault("content-type", content_type)
        chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        if (body or method in ("POST", "PUT", "PATCH")) and not chunked:
            fields.setdefault("content-length", str(len(body)))
        decoded = unquote(path.partition("?")[0])
        if not unifiedpush_http.PATHS.fullmatch(decoded):
            return PushResponse(404, [], b"not the resource's path: Django's 404")

        def header(name: str) -> str | None:
            return fields.get(name.lower())

        # A new one each time (its connections to gateways belong to one event loop).
        resource = unifiedpush_http.PushResource()
        refusal = resource.refusal(method, decoded, header)
        if refusal is not None:
            return PushResponse(*refusal)

        async def in_thread(work: Callable[[], Any]) -> Any:
            # In the test's own thread (asgiref hands it back there), on its database
            # connection and inside its transaction.
            return await sync_to_async(work, thread_sensitive=True)()

        kept = body[: resource.max_body_bytes]
        # As Django's test client does: the request must not close the test's connection.
        signals.request_started.disconnect(close_old_connections)
        signals.request_finished.disconnect(close_old_connections)

        async def answer_once() -> Any:
            try:
                return await resource.answer(method, decoded, header, kept, in_thread)
            finally:
                await resource.aclose()  # on this request's event loop, which ends with it

        try:
            answer = async_to_sync(answer_once)()
        finally:
            signals.request_started.connect(close_old_connections)
            signals.request_finished.connect(close_old_connections)
        return PushResponse(*answer)

    def post(
        self, path: str, data: bytes | str | dict[str, Any] = b"", **kwargs: Any
    ) -> PushResponse:
        return self.generic("POST", path, data, **kwargs)

    def get(self, path: str, **kwargs: Any) -> PushResponse:
        return self.generic("GET", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> PushResponse:
        return self.generic("DELETE", path, **kwargs)
