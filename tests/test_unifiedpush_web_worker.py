"""The web process's worker class (pushsite/web_worker.py): UnifiedPush POSTs answered before
gunicorn's parser, everything else handed back to gunicorn with the bytes already read.

Against the real web process (gunicorn with the Procfile's worker class) over raw sockets, so
keep-alive, pipelining and the hand-back are what a client sees; and `parse_head` alone for
what it must refuse to shortcut."""

from __future__ import annotations

import re
import socket
import time

import pytest

from pushsite.web_worker import parse_head
from relay.models import Component, Tenant
from relay.unifiedpush.models import UnifiedPushMessage
from relay.unifiedpush.services import messages
from tests.support.endpoints import new_endpoint
from tests.support.processes import start_web

TOKEN = "v4.local.abc-DEF_123"


def head(*lines: str) -> bytes:
    return "\r\n".join(lines).encode()


class TestParseHead:
    def test_plain_post(self):
        parsed = parse_head(
            head(f"POST /push/{TOKEN} HTTP/1.1", "Host: x", "TTL: 60", "Content-Length: 5")
        )
        assert parsed == (TOKEN, {"host": "x", "ttl": "60", "content-length": "5"}, 5, False)

    def test_connection_close_is_kept(self):
        parsed = parse_head(
            head(f"POST /push/{TOKEN} HTTP/1.1", "Content-Length: 0", "Connection: close")
        )
        assert parsed is not None and parsed[3] is True

    def test_repeated_headers_are_joined_as_wsgi_does(self):
        parsed = parse_head(
            head(f"POST /push/{TOKEN} HTTP/1.1", "TTL: 1", "TTL: 2", "Content-Length: 0")
        )
        assert parsed is not None and parsed[1]["ttl"] == "1,2"

    @pytest.mark.parametrize(
        "raw",
        [
            head(f"POST /push/{TOKEN} HTTP/1.0", "Content-Length: 0"),
            head(f"POST /push/{TOKEN}?x=1 HTTP/1.1", "Content-Length: 0"),
            head("POST /push/v4.local.a%2Fb HTTP/1.1", "Content-Length: 0"),
            head(f"POST /push/{TOKEN} HTTP/1.1", "Transfer-Encoding: chunked"),
            head(f"POST /push/{TOKEN} HTTP/1.1", "Content-Length: 5", "Expect: 100-continue"),
            head(f"POST /push/{TOKEN} HTTP/1.1"),  # no length
            head(f"POST /push/{TOKEN} HTTP/1.1", "Content-Length: 1", "Content-Length: 1"),
            head(f"POST /push/{TOKEN} HTTP/1.1", "Content-Length: -1"),
            head(f"POST /push/{TOKEN} HTTP/1.1", "Content-Length: 99999"),
            head(f"POST /push/{TOKEN} HTTP/1.1", "Content-Length : 0"),
            head(f"POST /push/{TOKEN} HTTP/1.1", "Content-Length: 0", " folded"),
            head(f"POST /push/{TOKEN} HTTP/1.1", "Content-Length: 0", "X: caf\u00e9"),
            head(f"POST /push/{TOKEN} HTTP/1.1", "Content-Length: 0", "Upgrade: h2c"),
            f"POST /push/{TOKEN} HTTP/1.1\nContent-Length: 0".encode(),
            head(f"POST  /push/{TOKEN} HTTP/1.1", "Content-Length: 0"),
        ],
    )
    def test_anything_unusual_goes_to_gunicorn(self, raw):
        assert parse_head(raw) is None


def _exchange(sock: socket.socket, data: bytes, answers: int) -> list[tuple[int, bytes, bytes]]:
    """Send `data`, read `answers` HTTP responses: (status, head, body) each."""
    sock.sendall(data)
    buffer = b""
    out = []
    deadline = time.monotonic() + 20
    while len(out) < answers:
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            response_head = buffer[:end]
            match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", response_head)
            length = int(match.group(1)) if match else 0
            if len(buffer) >= end + 4 + length:
                out.append(
                    (int(response_head[9:12]), response_head, buffer[end + 4 : end + 4 + length])
                )
                buffer = buffer[end + 4 + length :]
                continue
        assert time.monotonic() < deadline, buffer
        chunk = sock.recv(65536)
        if not chunk:
            break
        buffer += chunk
    return out


def _post(token: str, body: bytes, *extra: str) -> bytes:
    return (
        head(
            f"POST /push/{token} HTTP/1.1",
            "Host: localhost",
            f"Content-Length: {len(body)}",
            *extra,
        )
        + b"\r\n\r\n"
        + body
    )


@pytest.fixture
def web_endpoint(transactional_db):
    """The real web process; (it, its port, a component it serves, a live endpoint token)."""
    messages.reset_limits()
    web, url = start_web(RELAY_UNIFIEDPUSH_ENDPOINT_RATE="0/0", RELAY_UNIFIEDPUSH_TENANT_RATE="0/0")
    try:
        tenant = Tenant.objects.create(name="worker")
        component = Component.objects.create(
            tenant=tenant, jid="up.worker.example", secret="x", unifiedpush_endpoint_url=url
        )
        token = new_endpoint(component).rsplit("/", 1)[1]
        yield web, int(url.rsplit(":", 1)[1]), component, token
    finally:
        web.stop()


def test_the_web_process_answers_posts_itself_and_hands_the_rest_back(web_endpoint):
    web, port, _, token = web_endpoint
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        # Keep-alive, then two requests pipelined in one write, then the rest.
        [(status, first_head, _)] = _exchange(sock, _post(token, b"one", "TTL: 30"), 1)
        assert status == 201
        assert b"\r\nTTL: 30" in first_head and b"\r\nLocation: " in first_head
        assert b"\r\nX-Content-Type-Options: nosniff" in first_head
        answers = _exchange(sock, _post(token, b"two") + _post(token, b"three"), 2)
        assert [a[0] for a in answers] == [201, 201]
        # GET on the same connection goes through gunicorn and Django: discovery.
        [(status, _, body)] = _exchange(
            sock, head(f"GET /push/{token} HTTP/1.1", "Host: localhost") + b"\r\n\r\n", 1
        )
        assert status == 200 and b'"unifiedpush"' in body
        # Refusals answered by the shortcut: 413, 404, 400.
        [(status, _, _)] = _exchange(sock, _post(token, b"x" * 4097), 1)
        assert status == 413
        [(status, _, _)] = _exchange(sock, _post(token[:-3] + "AAA", b"x"), 1)
        assert status == 404
        [(status, _, _)] = _exchange(sock, _post(token, b"x", "TTL: soon"), 1)
        assert status == 400
        # Chunked: handed back, answered by the WSGI path (411), connection still usable.
        chunked = (
            head(f"POST /push/{token} HTTP/1.1", "Host: localhost", "Transfer-Encoding: chunked")
            + b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
        )
        [(status, _, _)] = _exchange(sock, chunked, 1)
        assert status == 411
        # A body bigger than any push: handed back, gunicorn reads and refuses it.
        [(status, _, _)] = _exchange(sock, _post(token, b"y" * 20000), 1)
        assert status == 413
        [(status, _, _)] = _exchange(sock, _post(token, b"four"), 1)
        assert status == 201
        # Adopted by the event loop again: a request in pieces, a pause between them.
        request = _post(token, b"in pieces")
        sock.sendall(request[:30])
        time.sleep(0.3)
        sock.sendall(request[30:-4])
        time.sleep(0.3)
        [(status, _, _)] = _exchange(sock, request[-4:], 1)
        assert status == 201
        # A request that stalls half-way: the connection is closed (READ_TIMEOUT, 5 s).
        sock.sendall(request[:40])
        sock.settimeout(10)
        started = time.monotonic()
        assert sock.recv(100) == b""
        assert 4 < time.monotonic() - started < 9
    # HTTP/1.0 and Connection: close are answered, then the connection ends.
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        [(status, close_head, _)] = _exchange(sock, _post(token, b"five", "Connection: close"), 1)
        assert status == 201 and b"\r\nConnection: close" in close_head
        assert sock.recv(10) == b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        request = _post(token, b"six").replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        [(status, _, _)] = _exchange(sock, request, 1)
        assert status == 201
    assert UnifiedPushMessage.objects.count() == 7
    log = web.log_text()
    assert "Traceback" not in log, log[-3000:]
    assert token not in log, "the access log names a token"
    assert re.search(r'"POST /push/… HTTP/1.1" 201', log), log[-2000:]


def test_a_component_saved_before_urls_were_checked_gets_answers_on_every_path(web_endpoint):
    """Its stored URL has a non-ASCII host: every POST is still answered at once (201 with
    the ASCII Location), on a new connection (a pool thread), a kept-alive one (the event
    loop), HTTP/1.0 and a pipelined request (gunicorn and the WSGI fast path). Before, the
    answer failed after the message was handled: closed, or, kept alive, never answered."""
    web, port, component, token = web_endpoint
    Component.objects.filter(pk=component.pk).update(
        unifiedpush_endpoint_url="http://пример.example"
    )
    location = b"\r\nLocation: http://xn--e1afmkfd.example/push/message/"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        # A refusal keeps the connection: the event loop serves it from here on.
        [(status, _, _)] = _exchange(sock, _post(token, b"x", "TTL: soon"), 1)
        assert status == 400
        for body in (b"first", b"second"):
            [(status, answer_head, _)] = _exchange(sock, _post(token, body), 1)
            assert status == 201 and location in answer_head
        # Pipelined behind a refusal: read ahead, so gunicorn and the WSGI path answer it.
        answers = _exchange(sock, _post(token, b"x", "TTL: soon") + _post(token, b"3rd"), 2)
        assert [answer[0] for answer in answers] == [400, 201]
        assert location in answers[1][1]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        [(status, answer_head, _)] = _exchange(sock, _post(token, b"fourth"), 1)
        assert status == 201 and location in answer_head
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        request = _post(token, b"fifth").replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        [(status, answer_head, _)] = _exchange(sock, request, 1)
        assert status == 201 and location in answer_head
    assert UnifiedPushMessage.objects.count() == 5
    assert "Traceback" not in web.log_text(), web.log_text()[-3000:]
