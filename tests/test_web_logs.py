"""No UnifiedPush capability in any line the web process logs.

An endpoint token lets whoever holds it push to a phone, a message reference lets them
withdraw a message. Testers found them in the development server's request lines, in
Django's "Method Not Allowed" / "Not Found" lines, in the web server's logs and in the
`request` Django attaches to its records. Here the real servers (the web process as the
Procfile runs it, and `manage.py runserver`) get requests of every shape that names a live
token, and their whole output is searched; `relay.logging.mask_secrets` alone for the shapes.
"""

from __future__ import annotations

import json
import logging
import re
import socket

import pytest
from django.http import HttpResponse
from django.test import RequestFactory
from django.utils.log import log_response

import relay.logging as relay_logging
from relay.models import Tenant
from relay.unifiedpush.services import messages
from tests.support.endpoints import new_endpoint
from tests.support.processes import ServiceProcess, start_dev_server, start_web
from tests.support.unifiedpush_components import serving_unifiedpush, set_endpoint_url
from tests.support.waiting import wait_until

TOKEN = "v4.local.4ojRFvuaHlxoJOk-W3ndu-zjmvz4zANiImFOTlaxBoZIJY2K.dmxVbjBkOGg"
REFERENCE = "AAAAAAAAAAE.0123456789abcdef01234567"


def _leaks(text: str, *secrets: str) -> list[str]:
    """The secrets (or any 16 characters of their payload) that appear in `text`."""
    found = []
    for secret in secrets:
        payload = secret.removeprefix("v4.local.")
        pieces = [payload[i : i + 16] for i in range(0, max(len(payload) - 15, 1), 8)]
        if secret in text or any(piece in text for piece in pieces):
            found.append(secret)
    return found


@pytest.mark.defaults
@pytest.mark.parametrize(
    "line, masked",
    [
        (f'"POST /push/{TOKEN} HTTP/1.1" 201', '"POST /push/… HTTP/1.1" 201'),
        (f"Not Found: /push//{TOKEN}", "Not Found: /push/…"),
        (f"Method Not Allowed: /push/{TOKEN}", "Method Not Allowed: /push/…"),
        (f"/push/{TOKEN}?topic=a&b", "/push/…"),
        (f"/push/v4%2E{TOKEN[3:]}", "/push/…"),
        (f"%2Fpush%2F{TOKEN}", "/push/…"),
        (f"/%70USH/%76%34.local.{TOKEN[9:]}", "/push/…"),
        (f"/push%252F{TOKEN}", "/push/…"),  # encoded twice
        (f"/%2570ush%25252f{TOKEN.replace('.', '%252E')}", "/push/…"),
        (f"a v4%25252Elocal%2E{TOKEN[9:]} b", "a … b"),
        (f"/push/message/{REFERENCE} 204", "/push/message/… 204"),
        (f"/push//message//{REFERENCE}", "/push/message/…"),
        (f"<WSGIRequest: PUT '/push/{TOKEN}'>", "<WSGIRequest: PUT '/push/…'>"),
        (f"https://push.example/push/{TOKEN}", "https://push.example/push/…"),
        (f"Mastodon/4.3 key={TOKEN}; x", "Mastodon/4.3 key=…; x"),
        (f"a V4.LOCAL.{TOKEN[9:]} b", "a … b"),
        ("/_matrix/push/v1/notify", "/_matrix/push/v1/notify"),
        ("unifiedpush.registered", "unifiedpush.registered"),
        ("/push/", "/push/"),
    ],
)
def test_every_shape_of_a_token_is_masked(line, masked):
    assert relay_logging.mask_secrets(line) == masked
    assert relay_logging.mask_secrets(masked) == masked


@pytest.mark.defaults
def test_the_json_formatter_never_writes_the_request_and_masks_every_value():
    path = f"/push/{TOKEN}"
    try:
        raise ValueError(f"while answering {path}")
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    record = logging.makeLogRecord(
        {
            "name": "django.request",
            "levelno": logging.ERROR,
            "levelname": "ERROR",
            "msg": "%s: %s",
            "args": ("Internal Server Error", path),
            "exc_info": exc_info,
            "request": RequestFactory().post(path),
            "status_code": 500,
            "paths": [path, {"again": path}],
        }
    )
    line = relay_logging.JsonFormatter().format(record)
    entry = json.loads(line)
    assert not _leaks(line, TOKEN), line
    assert "request" not in entry
    assert entry["event"] == "Internal Server Error: /push/…"
    assert entry["paths"] == ["/push/…", {"again": "/push/…"}]
    assert entry["status_code"] == 500 and entry["exc_type"] == "ValueError"


class _Collect(logging.Handler):
    """Lines as a plain handler an operator might add would write them (traceback too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.mark.defaults
@pytest.mark.parametrize(
    "logger_name",
    [
        "django.request",
        "django.server",
        "pushsite.access",
        "aiohttp.server",
        "aiohttp.web",
    ],
)
def test_request_records_are_masked_before_any_handler(logger_name):
    """The filter sits on every logger that may see a path (settings.LOGGING): Django's, the
    web server's access log and aiohttp's own, so a handler of any format (an operator's)
    gets the record masked: here Django's 500 line with its traceback, as `log_response`
    writes it."""
    path = f"/push/{TOKEN}"
    collect = _Collect()
    logger = logging.getLogger(logger_name)
    logger.addHandler(collect)
    try:
        try:
            raise RuntimeError(f"failed on {path}")
        except RuntimeError as error:
            log_response(
                "%s: %s",
                "Internal Server Error",
                path,
                response=HttpResponse(status=500),
                request=RequestFactory().post(path),
                exception=error,
                logger=logger,
            )
    finally:
        logger.removeHandler(collect)
    text = "\n".join(collect.lines)
    assert f"{logger_name} Internal Server Error: /push/…" in text
    assert "RuntimeError: failed on /push/…" in text
    assert not _leaks(text, TOKEN), text


# --------------------------------------------------------------------------- real servers
def _request(port: int, method: str, path: str, *headers: str, version: str = "HTTP/1.1") -> str:
    """One request on its own connection; the answer's head (empty if none came)."""
    host = [] if any(line.startswith("Host:") for line in headers) else ["Host: localhost"]
    head = [f"{method} {path} {version}", *host, "Connection: close", *headers]
    if method in ("POST", "PUT"):
        head.append("Content-Length: 5")
    data = (
        "\r\n".join(head).encode() + b"\r\n\r\n" + (b"hello" if method in ("POST", "PUT") else b"")
    )
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.split(b"\r\n\r\n", 1)[0].decode("latin-1")


def _status(head: str) -> int:
    return int(head[9:12]) if head.startswith("HTTP/1.") else 0


def _json_events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _exercise(web: ServiceProcess, url: str) -> tuple[list[str], dict[str, int]]:
    """Every request shape that names a live token or message reference; (the secrets,
    the status of each request by name)."""
    port = int(url.rsplit(":", 1)[1])
    tenant = Tenant.objects.create(name="logs")
    component = serving_unifiedpush(
        tenant=tenant, jid="up.logs.example", secret="x", endpoint_url=url
    )
    token = new_endpoint(component).rsplit("/", 1)[1]
    # A component saved before endpoint URLs were checked: its answers once crashed (500).
    old = serving_unifiedpush(
        tenant=tenant, jid="up-old.logs.example", secret="x", endpoint_url=url
    )
    old_token = new_endpoint(old).rsplit("/", 1)[1]
    set_endpoint_url(old, "http://пример.example")
    created = _request(port, "POST", f"/push/{token}")
    found = re.search(r"/push/message/(\S+)", created)
    assert found, created
    reference = found.group(1)
    payload = token.removeprefix("v4.local.")
    statuses = {
        "post": _status(created),
        "put": _status(_request(port, "PUT", f"/push/{token}")),
        "delete": _status(_request(port, "DELETE", f"/push/{token}")),
        "double slash": _status(_request(port, "POST", f"/push//{token}")),
        "query": _status(_request(port, "POST", f"/push/{token}?topic=x")),
        "percent": _status(_request(port, "POST", f"/push/v4%2Elocal.{payload}")),
        "percent get": _status(_request(port, "GET", f"/push/%76%34.local.{payload}")),
        "percent twice": _status(
            _request(port, "POST", f"/push%252F{token.replace('.', '%252E')}")
        ),
        "trailing slash": _status(_request(port, "GET", f"/push/{token}/")),
        "in headers": _status(
            _request(
                port,
                "PUT",
                f"/push/{token}",
                f"Referer: {url}/push/{token}",
                f"User-Agent: tester {token}",
            )
        ),
        "foreign host": _status(
            _request(port, "PUT", f"/push//{token}", "Host: elsewhere.example")
        ),
        "message get": _status(_request(port, "GET", f"/push/message/{reference}")),
        "message delete": _status(_request(port, "DELETE", f"/push/message/{reference}")),
        "old row": _status(_request(port, "POST", f"/push/{old_token}", version="HTTP/1.0")),
    }
    return [token, old_token, reference], statuses


@pytest.fixture
def server(request):
    messages.reset_limits()
    rates = {"RELAY_UNIFIEDPUSH_ENDPOINT_RATE": "0/0", "RELAY_UNIFIEDPUSH_TENANT_RATE": "0/0"}
    web, url = (start_web if request.param == "web" else start_dev_server)(**rates)
    try:
        yield web, url
    finally:
        web.stop()


# What each request gets from the UnifiedPush resource, and from Django for the paths that
# are not the resource's: the same from the web process and from runserver.
WEB = {
    "post": 201, "put": 405, "delete": 405, "double slash": 404, "query": 201, "percent": 201,
    "percent get": 200, "percent twice": 404, "trailing slash": 404, "in headers": 405,
    "foreign host": 400, "message get": 405, "message delete": 204, "old row": 201,
}  # fmt: skip


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("server", ["web", "runserver"], indirect=True)
def test_no_live_token_reaches_the_web_process_output(server):
    web, url = server
    secrets, statuses = _exercise(web, url)
    assert statuses == WEB
    # Every answered request has its lines, masked (the process's own log, in order).
    wait_until(lambda: "Not Found: /push/…" in _events_text(web))
    web.stop()
    text = web.log_text()
    assert not _leaks(text, *secrets), text[-4000:]
    events = _json_events(text)
    said = [event["event"] for event in events]
    assert "Not Found: /push/…" in said
    assert [event for event in events if event["logger"] == "django.security.DisallowedHost"]
    assert not [event for event in events if "request" in event]
    if web.name == "runserver":  # Django's request lines, JSON like every other line
        lines = [event["event"] for event in events if event["logger"] == "django.server"]
        assert any(line.startswith('"PUT /push/… HTTP/1.1" 405 ') for line in lines), lines
        assert any(line.startswith('"DELETE /push/message/… HTTP/1.1" 204') for line in lines)
        assert len([line for line in lines if " /push/" in line]) == 14, lines
    else:  # the web server's access log: one line per answer, whichever route made it
        lines = [event["event"] for event in events if event["logger"] == "pushsite.access"]
        assert any(line.endswith('"POST /push/… HTTP/1.1" 201 0') for line in lines), lines
        assert any('"PUT /push/… HTTP/1.1" 400' in line for line in lines), lines
        assert any('"DELETE /push/message/… HTTP/1.1" 204' in line for line in lines), lines
        assert any('"POST /push/… HTTP/1.0" 201' in line for line in lines), lines
        assert len([line for line in lines if " /push/" in line]) == 14, lines


def _events_text(web: ServiceProcess) -> str:
    return "\n".join(str(event.get("event")) for event in _json_events(web.log_text()))


# --- every line JSON: a missing static folder, Python's warnings ----------------------------


@pytest.mark.defaults
@pytest.mark.django_db(transaction=True)
def test_a_missing_static_folder_is_one_line_not_a_warning_per_worker(tmp_path):
    """Before `collectstatic` WhiteNoise warns in every worker; the web process says it once,
    in JSON, with what to run."""
    missing = tmp_path / "static"
    web, _ = start_web(workers=2, STATIC_ROOT=str(missing))
    web.stop()
    lines = web.log_text().splitlines()
    assert [line for line in lines if not line.startswith("{")] == [], lines
    events = _json_events(web.log_text())
    said = [event for event in events if event["event"] == "web.static_missing"]
    assert said == [
        {
            "ts": said[0]["ts"],
            "level": "WARNING",
            "logger": "pushsite.server",
            "event": "web.static_missing",
            "static_root": str(missing),
            "fix": "manage.py collectstatic --noinput",
        }
    ]
    assert not [event for event in events if "No directory at" in event["event"]]


@pytest.mark.defaults
def test_python_warnings_are_json_lines():
    import subprocess
    import sys

    from tests.support.processes import ROOT, service_env

    code = "import django, warnings; django.setup(); warnings.warn('careful', FutureWarning)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=service_env(DJANGO_SETTINGS_MODULE="pushsite.settings"),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    [line] = done.stderr.splitlines()
    event = json.loads(line)
    assert (event["level"], event["logger"], event["event"]) == (
        "WARNING",
        "py.warnings",
        "FutureWarning: careful",
    )
    assert event["where"] == "<string>:1"


@pytest.mark.django_db(transaction=True)
def test_runserver_serves_the_matrix_gateway_like_the_web_process():
    """A developer's `manage.py runserver` serves the whole site: the Matrix push gateway too,
    with the resource's own answers (not Django's 404)."""
    messages.reset_limits()
    web, url = start_dev_server()
    try:
        port = int(url.rsplit(":", 1)[1])
        discovery = _request(port, "GET", "/_matrix/push/v1/notify")
        not_json = _request(port, "POST", "/_matrix/push/v1/notify")  # "hello"
        not_allowed = _request(port, "PUT", "/_matrix/push/v1/notify")
    finally:
        web.stop()
    assert _status(discovery) == 200 and "application/json" in discovery
    assert _status(not_json) == 400 and _status(not_allowed) == 405
    assert "Allow: GET, POST" in not_allowed
