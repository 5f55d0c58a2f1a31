"""The web process (pushsite/server.py) over raw sockets, as hostile or careless clients use
it: kept-alive and pipelined requests answered in order and whole, every route on one
connection, clients that stop reading (a deadline on flushing, then a hard close: no
connection held for ever, nothing read without bound), header limits as configured, slow or
stalled heads and bodies that hold nothing anyone else needs. The real process, as the
Procfile starts it, on PostgreSQL; a worker in this process where a failure must be made.
"""

from __future__ import annotations

import asyncio
import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from pushsite import server
from relay.models import Component, Tenant
from relay.unifiedpush.models import UnifiedPushMessage
from relay.unifiedpush.services import messages
from tests.support import raw_http
from tests.support.endpoints import new_endpoint
from tests.support.processes import ServiceProcess, child_pids, start_web
from tests.support.raw_http import Reader, closed_by_peer, exchange, post, request
from tests.support.unifiedpush_components import serving_unifiedpush, set_endpoint_url
from tests.support.waiting import wait_until

LIMITS = {
    "WEB_HEAD_SECONDS": "2",
    "WEB_BODY_SECONDS": "2",
    "WEB_FLUSH_SECONDS": "1",
    "WEB_MAX_HEADERS": "20",
    "WEB_MAX_REQUEST_LINE": "2048",
    "WEB_MAX_HEAD_BYTES": "8192",
}
NO_RATES = {
    "RELAY_UNIFIEDPUSH_ENDPOINT_RATE": "0/0",
    "RELAY_UNIFIEDPUSH_TENANT_RATE": "0/0",
    "RELAY_UNIFIEDPUSH_MAX_STORED_PER_ENDPOINT": "1000",
}


def connect(port: int, timeout: float = 20, receive_buffer: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:  # before connecting: the window it offers stays that small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))


def answer_on_a_new_connection(port: int, data: bytes) -> raw_http.Answer:
    """A new connection's answer: the server is not held by the others (no time is asserted:
    where it matters, the test checks that the others are still held when it came)."""
    with connect(port, timeout=30.0) as sock:
        [answer] = exchange(sock, data)
    return answer


def _web_with_an_endpoint(**env: str) -> Iterator[tuple[ServiceProcess, int, Component, str]]:
    """The real web process; (it, its port, a component it serves, a live endpoint token)."""
    messages.reset_limits()
    web, url = start_web(**{**NO_RATES, **LIMITS, **env})
    try:
        tenant = Tenant.objects.create(name="web")
        component = serving_unifiedpush(
            tenant=tenant, jid="up.web.example", secret="x", endpoint_url=url
        )
        token = new_endpoint(component).rsplit("/", 1)[1]
        yield web, int(url.rsplit(":", 1)[1]), component, token
    finally:
        web.stop()


@pytest.fixture
def web_endpoint(transactional_db, collected_static):
    """The web process with short limits (LIMITS)."""
    yield from _web_with_an_endpoint()


@pytest.fixture
def patient_web_endpoint(transactional_db):
    """As `web_endpoint`, with a flush deadline (30 s) longer than a slow reader's pauses."""
    yield from _web_with_an_endpoint(WEB_FLUSH_SECONDS="30")


def test_every_route_on_one_kept_alive_connection(web_endpoint):
    web, port, _, token = web_endpoint
    with connect(port) as sock:
        [created] = exchange(sock, post(token, b"one", "TTL: 30"))
        assert created.status == 201
        assert created.header("TTL") == "30" and created.header("Location")
        assert created.header("X-Content-Type-Options") == "nosniff"
        # Two pipelined in one write, then Django on the same connection.
        answers = exchange(sock, post(token, b"two") + post(token, b"three"), 2)
        assert [a.status for a in answers] == [201, 201]
        [discovered] = exchange(sock, request("GET", f"/push/{token}"))
        assert discovered.status == 200 and b'"unifiedpush"' in discovered.body
        [health] = exchange(sock, request("GET", "/healthz"))
        assert health.status == 200
        # Refusals: too large, unknown, malformed TTL.
        assert exchange(sock, post(token, b"x" * 4097))[0].status == 413
        assert exchange(sock, post(token[:-3] + "AAA", b"x"))[0].status == 404
        assert exchange(sock, post(token, b"x", "TTL: soon"))[0].status == 400
        # Chunked: refused (a push needs its length), the body read and dropped.
        chunked = post(token, b"3\r\nabc\r\n0\r\n\r\n", "Transfer-Encoding: chunked")
        assert exchange(sock, chunked)[0].status == 411
        # A body larger than any push: read and dropped, refused, the connection kept.
        assert exchange(sock, post(token, b"y" * 20000))[0].status == 413
        assert exchange(sock, post(token, b"four"))[0].status == 201
        # A request in pieces.
        data = post(token, b"in pieces")
        sock.sendall(data[:30])
        sock.sendall(data[30:-4])
        assert exchange(sock, data[-4:])[0].status == 201
        # A request that stalls half-way: closed at the body's deadline (2 s here).
        started = time.monotonic()
        sock.sendall(data[:-2])
        assert closed_by_peer(sock, timeout=15)
        assert time.monotonic() - started > 1.5
    # Connection: close and HTTP/1.0 are answered, then the connection ends.
    with connect(port) as sock:
        [closing] = exchange(sock, post(token, b"five", "Connection: close"))
        assert closing.status == 201 and closing.header("Connection") == "close"
        assert closed_by_peer(sock, timeout=5)
    with connect(port) as sock:
        [old] = exchange(sock, post(token, b"six").replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        assert old.status == 201
        assert closed_by_peer(sock, timeout=5)
    assert UnifiedPushMessage.objects.count() == 7
    log = web.log_text()
    assert "Traceback" not in log, log[-3000:]
    assert token not in log, "a log line names a token"


def test_pipelined_answers_come_in_order_and_whole_to_a_slow_reader(patient_web_endpoint):
    """On a kept-alive connection (one POST answered first, as an application server's),
    20,000 POSTs pipelined (most to an unknown endpoint: cheap 404s), 19,000 at once and the
    rest over 6 s, by a client that starts reading only after 8 s: the answers fill the
    socket buffers and wait there while more requests come; each answer arrives whole, in
    the order asked, none lost or spliced into another."""
    _, port, _, token = patient_web_endpoint
    count, burst, batch = 20000, 19000, 10
    unknown = token[:-3] + "AAA"
    requests = [post(token if n % 40 == 20 else unknown, b"n%d" % n) for n in range(count)]
    expected = [201 if n % 40 == 20 else 404 for n in range(count)]
    with connect(port, timeout=60) as sock:
        assert exchange(sock, post(token, b"first"))[0].status == 201

        def send() -> None:
            sock.sendall(b"".join(requests[:burst]))
            started = time.monotonic()
            for first in range(burst, count, batch):
                # An even pace, whatever the server does.
                due = started + 6.0 * (first - burst) / (count - burst)
                if (wait := due - time.monotonic()) > 0:
                    select.select([], [], [], wait)
                sock.sendall(b"".join(requests[first : first + batch]))

        sender = threading.Thread(target=send)
        sender.start()
        sender.join(timeout=8)  # done, or blocked by a server that reads no further
        answers = Reader(sock).answers(count, timeout=120)
        sender.join(timeout=30)
    assert [a.status for a in answers] == expected
    assert all(a.body == b'{"error": "no such endpoint"}' for a in answers if a.status == 404)
    locations = [a.header("Location") for a in answers if a.status == 201]
    assert all(a.header("TTL") for a in answers if a.status == 201)
    assert len(set(locations)) == len(locations) == count // 40
    assert UnifiedPushMessage.objects.count() == 1 + count // 40


def test_clients_that_stop_reading_are_closed_at_the_flush_deadline(web_endpoint, collected_static):
    """Twenty clients pipeline until nothing more is taken, never reading, then ask to close:
    each is closed by the server (WEB_FLUSH_SECONDS, 1 s here), and the server answers
    others all along. (Large static files: a few fill the socket buffers.)"""
    web, port, _, token = web_endpoint
    stuck = []
    for _ in range(20):
        sock = connect(port, receive_buffer=4096)
        sock.setblocking(False)
        chunk = request("GET", collected_static) * 20
        with pytest.raises(BlockingIOError):  # until the buffers on both sides are full
            while True:
                sock.send(chunk)
        with suppress(BlockingIOError):
            sock.send(request("GET", "/healthz", "Connection: close"))
        stuck.append(sock)
    with connect(port) as sock:  # answered meanwhile (after the static files queued before it)
        assert exchange(sock, request("GET", "/healthz"))[0].status == 200
    # Every one of them ends (reset: what was not sent is dropped), and nothing is held.
    wait_until(lambda: raw_http.established(port) == 0)
    for sock in stuck:
        sock.setblocking(True)
        assert closed_by_peer(sock, timeout=5)
        sock.close()
    assert "web.flush_timeout" in web.log_text()
    assert answer_on_a_new_connection(port, post(token, b"after")).status == 201


def test_a_client_pipelining_faster_than_it_is_answered_is_read_no_further_than_a_bound(
    web_endpoint,
):
    """On a kept-alive connection, a client sends POSTs as fast as it can and reads the
    answers as they come: the worker
    reads its requests no further ahead than one chunk, so the client's sends wait for the
    answers (what it sent minus what was answered stays within the kernel's buffers), and
    the worker's memory does not grow with what was offered (8 s of it)."""
    web, port, _, token = web_endpoint
    [worker] = child_pids(web.process.pid)
    before = rss_kib(worker)
    one = post(token, b"x" * 4000)
    batch = one * 256
    sent = answered = most_ahead = 0
    with connect(port) as sock:
        assert exchange(sock, post(token, b"first"))[0].status == 201  # kept alive from here
        done = threading.Event()

        def read() -> None:
            nonlocal answered
            reader = Reader(sock)
            while not done.is_set() or answered * len(one) < sent:
                try:
                    answered += len(reader.answers(1, timeout=10))
                except (AssertionError, OSError):
                    return

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 8
        sock.settimeout(1)
        while time.monotonic() < deadline and sent < 64 * 1024 * 1024:
            with suppress(TimeoutError):
                sent += sock.send(batch)
            most_ahead = max(most_ahead, sent - answered * len(one))
        done.set()
        reader.join(timeout=60)
    assert answered > 100, answered  # it was answered all along
    # The kernel's buffers on both sides (4 MiB on loopback here); unbounded grows with time.
    assert most_ahead < 10 * 1024 * 1024, (most_ahead, sent)
    assert rss_kib(worker) - before < 24 * 1024
    assert answer_on_a_new_connection(port, post(token, b"after")).status == 201


def test_header_limits_are_the_configured_ones(web_endpoint):
    _, port, _, token = web_endpoint
    fields = [f"X-Field-{n}: {n}" for n in range(19)]  # with Host: 20, the limit here
    with connect(port) as sock:
        assert exchange(sock, request("GET", "/healthz", *fields))[0].status == 200
    with connect(port) as sock:
        [answer] = exchange(sock, request("GET", "/healthz", *fields, "X-One-More: 1"))
        assert answer.status == 431
        assert answer.header("X-Content-Type-Options") == "nosniff"
        assert closed_by_peer(sock, timeout=5)
    with connect(port) as sock:
        [answer] = exchange(sock, post(token + "A" * 2048, b"x"))
        assert answer.status == 414
        assert closed_by_peer(sock, timeout=5)
    # A thousand fields, or one of 9,000 bytes: past the head's 8192 bytes, the connection
    # is closed without an answer.
    for lines in ([f"X-{n}: {n}" for n in range(1000)], ["X-Big: " + "b" * 9000]):
        with connect(port) as sock:
            sock.sendall(request("GET", "/healthz", *lines))
            assert closed_by_peer(sock, timeout=5)
    assert answer_on_a_new_connection(port, request("GET", "/healthz")).status == 200


@pytest.fixture
def stalling_web(transactional_db):
    """Head and body deadlines (8 s) longer than answering a few requests on a loaded machine."""
    yield from _web_with_an_endpoint(WEB_HEAD_SECONDS="8", WEB_BODY_SECONDS="8")


def test_slow_and_stalled_heads_and_bodies_hold_nothing_others_need(stalling_web):
    """200 connections stall (a head never finished, a body never finished, nothing sent):
    /healthz and POSTs are answered meanwhile, and each stalled one is closed at its deadline
    (8 s here)."""
    _, port, _, token = stalling_web
    stalled = []
    for n in range(200):
        sock = connect(port)
        if n % 3 == 0:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localh")
        elif n % 3 == 1:
            sock.sendall(post(token, b"z" * 100)[:-50])
        stalled.append(sock)
    for _ in range(3):
        assert answer_on_a_new_connection(port, request("GET", "/healthz")).status == 200
        assert answer_on_a_new_connection(port, post(token, b"meanwhile")).status == 201
    # Answered while the stalled ones were still held, not once their deadline freed them.
    assert raw_http.established(port) >= len(stalled)
    for sock in stalled:
        assert closed_by_peer(sock, timeout=30)
        sock.close()
    wait_until(lambda: raw_http.established(port) == 0)


def test_a_component_saved_before_urls_were_checked_gets_answers_on_every_path(web_endpoint):
    """Its stored URL has a non-ASCII host: every POST is answered (201 with the ASCII
    Location), kept alive, pipelined behind a refusal, and over HTTP/1.0."""
    web, port, component, token = web_endpoint
    set_endpoint_url(component, "http://пример.example")
    messages.policies.clear()
    location = "http://xn--e1afmkfd.example/push/message/"
    with connect(port, timeout=5) as sock:
        assert exchange(sock, post(token, b"x", "TTL: soon"))[0].status == 400
        for body in (b"first", b"second"):
            [answer] = exchange(sock, post(token, body))
            assert answer.status == 201 and answer.header("Location").startswith(location)
        answers = exchange(sock, post(token, b"x", "TTL: soon") + post(token, b"3rd"), 2)
        assert [answer.status for answer in answers] == [400, 201]
    with connect(port, timeout=5) as sock:
        [answer] = exchange(sock, post(token, b"fourth").replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        assert answer.status == 201 and answer.header("Location").startswith(location)
    assert UnifiedPushMessage.objects.count() == 4
    assert "Traceback" not in web.log_text(), web.log_text()[-3000:]


def test_absolute_form_targets_are_routed_as_the_origin_form(web_endpoint):
    """RFC 9112 3.2.2: a server MUST accept `GET http://host/path`; the authority is the
    host (the Host field ignored). The UnifiedPush resource stores the push, Django answers."""
    web, port, _, token = web_endpoint
    with connect(port) as sock:
        [health] = exchange(sock, request("GET", "http://localhost/healthz", "Host: elsewhere"))
        assert health.status == 200 and health.body == b'{"status": "ok"}'
        [pushed] = exchange(
            sock,
            post(token, b"absolute").replace(
                f"/push/{token}".encode(), f"HTTP://localhost:{port}/push/{token}".encode(), 1
            ),
        )
        assert pushed.status == 201, pushed.body
        [query] = exchange(sock, request("GET", "http://localhost?x=1"))  # an empty path: "/"
        assert query.status == 404
    assert UnifiedPushMessage.objects.count() == 1
    assert token not in web.log_text()


def test_any_header_byte_reaches_django_and_deep_json_is_a_bad_request(web_endpoint):
    """Header values reach Django as latin-1 strings of the bytes that came (PEP 3333): a
    UTF-8 cookie is a cookie like any other, not a 500. JSON nested deeper than the stack
    posted to the Matrix gateway is a 400, and nothing is stored."""
    web, port, _, token = web_endpoint
    with connect(port) as sock:
        for path in ("/healthz", "/admin/login/"):
            [answer] = exchange(sock, request("GET", path, "Cookie: a=\u20ac; b=caf\u00e9"))
            assert answer.status == 200, (path, answer.body[:300])
        raw_field = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Raw: \xff\xfe\r\n\r\n"
        [raw] = exchange(sock, raw_field)
        assert raw.status == 200
    pushkey = f"http://localhost:{port}/push/{token}"
    deep = [b"[" * 60000]  # within the gateway's 64 KiB
    for depth in (900, 980, 990, 995, 998, 1000, 1100):  # around the interpreter's limit
        nested = b"[" * depth + b"]" * depth
        deep.append(
            b'{"notification": {"devices": [{"pushkey": "%s"}], "x": %s}}'
            % (pushkey.encode(), nested)
        )
    relayed = 0
    with connect(port) as sock:
        for body in deep:
            [answer] = exchange(
                sock,
                request(
                    "POST", "/_matrix/push/v1/notify", "Content-Type: application/json", body=body
                ),
            )
            assert answer.status in (200, 400), (answer.status, len(body), answer.body)
            if answer.status == 400:
                assert b"M_BAD_JSON" in answer.body or b"M_NOT_JSON" in answer.body
            relayed += answer.status == 200
        assert answer.status == 400  # 1,100 deep
    assert UnifiedPushMessage.objects.count() == relayed  # a refused one stored nothing
    log = web.log_text()
    assert "Traceback" not in log and '"level": "ERROR"' not in log, log[-3000:]


DEFAULT_HEADS = {  # the defaults (relay/environment.py), which the attacks below were sized for
    "WEB_MAX_HEADERS": "100",
    "WEB_MAX_HEAD_BYTES": "16384",
    "WEB_MAX_REQUEST_LINE": "8190",
    "WEB_FLUSH_SECONDS": "30",
}


@pytest.fixture
def default_heads_web(transactional_db):
    yield from _web_with_an_endpoint(**DEFAULT_HEADS)


def _hostile(port: int, data: bytes, times: int) -> None:
    """Send `data` `times` times on one connection, pipelined, never reading; until the
    server closes it."""
    with connect(port, timeout=20) as sock, suppress(OSError):
        for _ in range(times):
            sock.sendall(data)


def test_hostile_heads_and_bodies_hold_no_more_than_the_documented_bound(default_heads_web):
    """Pipelined heads of 100 fields of 16,000 bytes (1.6 MB each, within aiohttp's own
    per-field and count limits), and pipelined 900 KiB bodies, on four connections that
    never read: the worker's memory grows by less than docs/web.md's bound for four
    connections (3 x (WEB_MAX_HEAD_BYTES + WEB_MAX_BODY_BYTES + 256 KiB) each), where it
    once queued 32 such heads per connection (hundreds of MiB, kept after)."""
    _, port, _, _ = default_heads_web
    web = default_heads_web[0]
    [worker] = child_pids(web.process.pid)
    fields = "".join(f"X-F{n}: {'a' * 16000}\r\n" for n in range(100))
    head = f"GET /healthz HTTP/1.1\r\nHost: localhost\r\n{fields}\r\n".encode()
    body = request("POST", "/healthz", body=b"b" * (900 * 1024))
    for _ in range(3):  # the worker's own growth first: Django's first answers, its threads
        with connect(port) as sock:
            exchange(sock, body + request("GET", "/healthz", "X-F: " + "a" * 8000), 2)
    before = rss_kib(worker)
    peak = before
    senders = [
        threading.Thread(target=_hostile, args=(port, data, 34))
        for data in (head, head, body, body)
    ]
    for sender in senders:
        sender.start()
    while any(sender.is_alive() for sender in senders):
        peak = max(peak, rss_kib(worker))
        select.select([], [], [], 0.02)
    peak = max(peak, rss_kib(worker))
    print(f"the worker's RSS: {before} KiB before, {peak} KiB at most meanwhile")
    per_connection = 3 * (16384 + 1024 * 1024 + 256 * 1024) // 1024  # KiB
    assert peak - before < 4 * per_connection + 16 * 1024, (before, peak)
    assert answer_on_a_new_connection(port, request("GET", "/healthz")).status == 200


def test_a_head_is_refused_while_it_is_read(web_endpoint):
    """Past WEB_MAX_HEAD_BYTES (8192 here) without its end, a head is answered 431 and the
    connection closed then, not once the head is whole."""
    _, port, _, _ = web_endpoint
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-A: " + b"a" * 5000)
        sock.sendall(b"\r\nX-B: " + b"b" * 5000)  # 10 KB, no end of head yet
        [answer] = Reader(sock).answers(1, timeout=10)
        assert answer.status == 431 and answer.header("Connection") == "close"
        assert answer.header("X-Content-Type-Options") == "nosniff"
        assert closed_by_peer(sock, timeout=5)
    assert answer_on_a_new_connection(port, request("GET", "/healthz")).status == 200


@pytest.fixture
def capped_web(transactional_db):
    """At most 20 connections, a body deadline longer than the test."""
    yield from _web_with_an_endpoint(WEB_MAX_CONNECTIONS="20", WEB_BODY_SECONDS="60")


def test_at_the_connection_cap_idle_connections_make_room_and_busy_ones_a_503(capped_web):
    """30 connections that never send a head: the oldest are closed as new ones come, and
    a client is answered meanwhile. 20 connections whose bodies are being read: a new one
    is refused with a 503 and Connection: close, and served once they end."""
    web, port, _, token = capped_web
    idle = [connect(port) for _ in range(30)]
    assert answer_on_a_new_connection(port, request("GET", "/healthz")).status == 200
    wait_until(lambda: raw_http.established(port) <= 20)
    # The oldest went first: the ten (and one more for the request above) opened first.
    assert all(closed_by_peer(sock, timeout=5) for sock in idle[:11])
    for sock in idle:
        sock.close()
    wait_until(lambda: raw_http.established(port) == 0)
    busy = []
    for _ in range(20):  # each told to send its body (being answered), which never comes
        sock = connect(port)
        data = post(token, b"z" * 100, "Expect: 100-continue")
        sock.sendall(data[: data.index(b"\r\n\r\n") + 4])
        continued = b""
        while b"\r\n\r\n" not in continued:
            continued += sock.recv(1024)
        assert continued.startswith(b"HTTP/1.1 100 Continue\r\n")
        busy.append(sock)
    with connect(port, timeout=5) as sock:
        [refused] = Reader(sock).answers(1, timeout=10)
        assert refused.status == 503 and refused.header("Connection") == "close"
        assert refused.header("X-Content-Type-Options") == "nosniff"
        assert closed_by_peer(sock, timeout=5)
    for sock in busy:
        sock.close()
    wait_until(lambda: raw_http.established(port) == 0)
    assert answer_on_a_new_connection(port, request("GET", "/healthz")).status == 200
    wait_until(lambda: '"web.connection_cap"' in web.log_text())  # said in the log


def test_the_connection_cap_stays_below_the_open_file_limit(transactional_db):
    """Under an open-file limit of 256 (the cap, 1000, lowered to 128): 300 connections that
    never send a head do not make new ones close unanswered."""
    messages.reset_limits()
    # Connections that never send a head wait for it as long as production's do, here 60 s.
    limits = {**LIMITS, "WEB_HEAD_SECONDS": "60"}
    web, url = start_web(prefix=["prlimit", "--nofile=256:256"], **limits)
    try:
        port = int(url.rsplit(":", 1)[1])
        idle = [connect(port) for _ in range(300)]
        for _ in range(3):
            assert answer_on_a_new_connection(port, request("GET", "/healthz")).status == 200
        wait_until(lambda: raw_http.established(port) <= 128)
        for sock in idle:
            sock.close()
        assert '"cap": 128' in web.log_text()
    finally:
        web.stop()


# --------------------------------------------------------------------------- in this process
class _Resource:
    """A stand-in for the UnifiedPush resource that fails the way a bug would, or waits."""

    max_body_bytes = 4097
    paths = re.compile(r"/push/.*")

    def __init__(self) -> None:
        self.holding = threading.Event()  # a request waits in /push/slow
        self.release = asyncio.Event()

    def refusal(self, method, path, header):
        return None

    async def answer(self, method, path, header, body, in_thread):
        if path == "/push/raise":
            raise RuntimeError("a bug after the message was handled")
        if path == "/push/unsendable":
            return 201, [("Location", "https://a.example/\r\nSet-Cookie: x=1")], b""
        if path == "/push/slow":
            self.holding.set()
            await self.release.wait()
        return 201, [("Location", "https://a.example/push/message/x")], b""


def _django(environ, start_response):
    if environ["PATH_INFO"] == "/unsendable":
        start_response("200 OK", [("X-Bad", "a\nb")])
    else:
        start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"django"]


class Worker:
    """One worker (the same `serve` the process runs) on a thread of its own."""

    def __init__(self, **limits: float) -> None:
        self.sockets = server.bind_sockets(0, "127.0.0.1")
        self.port = self.sockets[0].getsockname()[1]
        self.resource = _Resource()
        defaults = {
            "max_head_bytes": 8192, "max_headers": 20, "max_request_line": 2048,
            "max_body_bytes": 65536, "head_seconds": 5.0, "body_seconds": 5.0,
            "flush_seconds": 1.0, "graceful_seconds": 5.0,
        }  # fmt: skip
        self.limits = server.Limits(**{**defaults, **limits})
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopped: asyncio.Event | None = None
        ready = threading.Event()

        async def run() -> None:
            self.loop, self.stopped = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await server.serve(self.sockets, self.site, self.stopped)

        self.thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
        self.thread.start()
        assert ready.wait(5)

    def site(self) -> server.Site:
        self.site_made = server.Site(
            django=_django, resources=[self.resource],
            limits=self.limits, threads=2,
        )  # fmt: skip
        return self.site_made

    def on_loop(self, call) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(call)

    def stop(self) -> None:
        assert self.stopped is not None
        self.on_loop(self.stopped.set)

    def join(self) -> None:
        with suppress(RuntimeError):  # its loop already ended (stopped by the test)
            self.stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the worker did not stop"


@contextmanager
def in_process_worker(**limits: float) -> Iterator[Worker]:
    worker = Worker(**limits)
    try:
        yield worker
    finally:
        worker.join()


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.defaults
def test_a_failure_after_the_answer_was_computed_never_leaves_the_client_waiting():
    with in_process_worker() as worker:
        for method, path in (("POST", "/push/raise"), ("POST", "/push/unsendable"),
                             ("GET", "/unsendable")):  # fmt: skip
            with connect(worker.port, timeout=5) as sock:
                body = b"x" if method == "POST" else b""
                [answer] = exchange(sock, request(method, path, body=body))
                assert answer.status == 500, path
                assert answer.header("Connection") == "close"
                assert answer.header("X-Content-Type-Options") == "nosniff"
                assert closed_by_peer(sock, timeout=5)
        with connect(worker.port, timeout=5) as sock:  # the worker serves on
            assert exchange(sock, request("POST", "/push/fine", body=b"x"))[0].status == 201


@pytest.mark.defaults
def test_a_stopping_worker_answers_what_it_holds_then_closes():
    with in_process_worker() as worker:
        idle = connect(worker.port, timeout=5)
        assert exchange(idle, request("GET", "/healthz"))[0].status == 200
        busy = connect(worker.port, timeout=5)
        busy.sendall(request("POST", "/push/slow", body=b"x"))
        assert worker.resource.holding.wait(5)
        worker.stop()
        assert closed_by_peer(idle, timeout=5)  # idle: closed at once
        wait_until(lambda: not _accepts(worker.port), timeout=5)  # accepts no more
        worker.on_loop(worker.resource.release.set)
        [answer] = Reader(busy).answers(1, timeout=5)
        assert answer.status == 201 and answer.header("Connection") == "close"
        assert closed_by_peer(busy, timeout=5)
        idle.close()
        busy.close()


@pytest.mark.defaults
def test_heads_aiohttps_parser_refuses_are_answered_with_our_headers(caplog):
    """Beyond aiohttp's own limits (twice the fields allowed, a field longer than the head
    may be) and for a malformed head, aiohttp answers through our `Connection.handle_error`:
    431 or 400 with our security headers, an access line, then the connection is closed. This
    fails if aiohttp stops calling `handle_error` or changes how it says "too many headers"."""
    fields = [f"X-{n}: {n}" for n in range(50)]  # more than 2 * 20
    cases = {
        "too many fields": (request("GET", "/healthz", *fields), 431),
        "a field longer than the head": (request("GET", "/x", "X-Big: " + "b" * 9000), 431),
        "a target longer than the head": (request("GET", "/" + "p" * 9000), 431),
        "malformed": (b"GET /healthz HTTP/1.1\r\nHost localhost\r\n\r\n", 400),
    }
    with in_process_worker() as worker, caplog.at_level("INFO", logger="pushsite.access"):
        for name, (data, status) in cases.items():
            with connect(worker.port, timeout=5) as sock:
                [answer] = exchange(sock, data)
                assert answer.status == status, name
                assert answer.header("X-Content-Type-Options") == "nosniff", name
                assert closed_by_peer(sock, timeout=5), name  # (an HTTP/1.0 answer: no header)
        with connect(worker.port, timeout=5) as sock:  # the worker serves on
            assert exchange(sock, request("GET", "/fine"))[0].status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "pushsite.access"]
    assert sum(" 431 " in line for line in lines) == 3, lines
    assert sum(" 400 " in line for line in lines) == 1, lines


@pytest.mark.defaults
def test_what_aiohttp_queues_is_where_we_read_it():
    """`server.queued` reads aiohttp's private queue of parsed requests: three pipelined
    requests behind one being answered are parsed in one read, two wait there (this fails if
    aiohttp renames or reshapes it), and are answered in order once it is."""
    with in_process_worker() as worker, connect(worker.port, timeout=5) as sock:
        sock.sendall(b"".join(request("POST", f"/push/{name}", body=b"x")
                              for name in ("slow", "a", "b")))  # fmt: skip
        assert worker.resource.holding.wait(5)
        counts: list[int] = []
        asked = threading.Event()

        def count() -> None:
            counts.extend(server.queued(connection) for connection in worker.site_made.connections)
            asked.set()

        worker.on_loop(count)
        assert asked.wait(5)
        assert counts == [2]
        worker.on_loop(worker.resource.release.set)
        assert [a.status for a in Reader(sock).answers(3, timeout=5)] == [201, 201, 201]
