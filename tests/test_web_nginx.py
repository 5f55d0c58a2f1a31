"""The documented reverse proxy, run: a real nginx with deploy/nginx/push-relay.conf (the text
docs/web.md shows; only the addresses, certificate and log paths are this test's) in front of
the real web process. Requests reach the web process over HTTP/1.1 on a kept-alive
connection, so what the benchmarks measure is what runs behind the proxy; no token reaches
any file nginx writes, whatever nginx refuses or fails to pass on."""

from __future__ import annotations

import http.client
import os
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from relay.models import Tenant
from relay.unifiedpush.services import messages
from tests.support import raw_http
from tests.support.endpoints import new_endpoint
from tests.support.ports import free_port, port_accepts
from tests.support.processes import ROOT, ServiceProcess, start_web
from tests.support.unifiedpush_components import serving_unifiedpush
from tests.support.waiting import wait_until
from tests.test_uwpx_listener import write_self_signed

HOST = "push.example.org"
CONFIG = ROOT / "deploy" / "nginx" / "push-relay.conf"


@dataclass
class Proxied:
    port: int  # nginx's
    web: ServiceProcess
    web_port: int
    token: str  # of a live endpoint
    log: Path  # nginx's access log
    folder: Path  # every file nginx writes


def documented_config(folder: Path, web_port: int, port: int) -> str:
    """The documented file with this test's addresses and paths, each replaced exactly once."""
    cert_path, key_path = write_self_signed(folder, HOST)
    text = CONFIG.read_text()
    assert text in (ROOT / "docs" / "web.md").read_text(), "docs/web.md shows another config"
    for old, new in (
        ("server 127.0.0.1:8000;", f"server 127.0.0.1:{web_port};"),
        ("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;"),
        (f"/etc/letsencrypt/live/{HOST}/fullchain.pem", str(cert_path)),
        (f"/etc/letsencrypt/live/{HOST}/privkey.pem", str(key_path)),
        ("/var/log/nginx/push-relay.log", str(folder / "access.log")),
        ("/var/log/nginx/push-relay.error.log", str(folder / "push-relay.error.log")),
    ):
        assert text.count(old) == 1, f"the documented config no longer has {old!r}"
        text = text.replace(old, new)
    return text


@pytest.fixture
def nginx_in_front(transactional_db, tmp_path) -> Iterator[Proxied]:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(binary).exists(), "nginx is missing: `make test` installs it (as root)"
    messages.reset_limits()
    web, url = start_web(ALLOWED_HOSTS=f"{HOST},127.0.0.1,localhost")
    port = free_port()
    (tmp_path / "push-relay.conf").write_text(
        documented_config(tmp_path, int(url.rsplit(":", 1)[1]), port)
    )
    user = "user root;" if os.geteuid() == 0 else ""
    (tmp_path / "nginx.conf").write_text(
        f"""{user}
daemon off;
worker_processes 1;
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log info;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
    fastcgi_temp_path {tmp_path}/fastcgi;
    uwsgi_temp_path {tmp_path}/uwsgi;
    scgi_temp_path {tmp_path}/scgi;
    include {tmp_path}/push-relay.conf;
}}
"""
    )
    nginx = subprocess.Popen(
        [binary, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: nginx.poll() is not None or port_accepts(port))
        assert nginx.poll() is None, (tmp_path / "error.log").read_text()
        tenant = Tenant.objects.create(name="proxied")
        component = serving_unifiedpush(
            tenant=tenant, jid="up.proxied.example", secret="x",
            endpoint_url=f"https://{HOST}",
        )  # fmt: skip
        token = new_endpoint(component).rsplit("/", 1)[1]
        yield Proxied(
            port, web, int(url.rsplit(":", 1)[1]), token, tmp_path / "access.log", tmp_path
        )
    finally:
        nginx.terminate()
        nginx.wait(10)
        web.stop()
        assert "Traceback" not in web.log_text(), web.log_text()[-3000:]


def test_through_the_documented_nginx_on_one_kept_alive_upstream_connection(nginx_in_front):
    port, token, access_log = nginx_in_front.port, nginx_in_front.token, nginx_in_front.log
    tls = ssl.create_default_context()
    tls.check_hostname = False
    tls.verify_mode = ssl.CERT_NONE
    for n in range(10):  # each client on a connection of its own, as application servers
        client = http.client.HTTPSConnection("127.0.0.1", port, timeout=20, context=tls)
        try:
            client.request("POST", f"/push/{token}", body=b"n%d" % n, headers={"Host": HOST})
            answer = client.getresponse()
            answer.read()
            assert answer.status == 201
            assert answer.headers["Location"].startswith(f"https://{HOST}/push/message/")
            assert answer.headers["X-Content-Type-Options"] == "nosniff"
            client.request("GET", "/healthz", headers={"Host": HOST})
            health = client.getresponse()
            assert health.status == 200 and health.read() == b'{"status": "ok"}'
        finally:
            client.close()
    # Twenty requests from ten clients came over one upstream connection, still open for the
    # next (nginx's default, HTTP/1.0, would have opened and closed one per request).
    assert raw_http.established(nginx_in_front.web_port) == 1
    web_log = nginx_in_front.web.log_text().splitlines()
    requests = [line for line in web_log if "pushsite.access" in line]
    # The twenty (and the start's readiness probe): HTTP/1.1, never nginx's default 1.0.
    assert len(requests) >= 20 and all("HTTP/1.1" in line for line in requests), requests
    wait_until(lambda: access_log.exists() and access_log.read_text().count("\n") >= 20)
    logged = access_log.read_text()
    assert token not in logged and '"POST /push/... HTTP/1.1" 201' in logged, logged


def _client(port: int) -> http.client.HTTPSConnection:
    tls = ssl.create_default_context()
    tls.check_hostname = False
    tls.verify_mode = ssl.CERT_NONE
    return http.client.HTTPSConnection("127.0.0.1", port, timeout=20, context=tls)


def _ask(port: int, method: str, path: str, body: bytes = b"", **headers: str) -> int:
    client = _client(port)
    try:
        client.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        client.putheader("Host", HOST)
        for name, value in headers.items():
            client.putheader(name.replace("_", "-"), value)
        client.putheader("Content-Length", str(len(body)))
        client.endheaders(body)
        answer = client.getresponse()
        answer.read()
        return answer.status
    except (ConnectionError, http.client.HTTPException):
        return 0  # nginx may close before reading a body it refuses
    finally:
        client.close()


def test_no_token_in_any_file_nginx_writes_whatever_it_refuses_or_cannot_pass_on(
    nginx_in_front,
):
    """nginx's error lines name the request line as it came: a body over the limit (413), and
    every POST while the web process is down (502) once wrote `request: "POST /push/<token>"`
    to its error log, and a path encoded twice reached the access log whole. Here nginx's
    main error log is at `info` (more than production needs) and every file nginx wrote is
    searched. A UTF-8 cookie reaches Django as a cookie through nginx too (200, not 500)."""
    port, token, folder = nginx_in_front.port, nginx_in_front.token, nginx_in_front.folder
    payload = token.removeprefix("v4.local.")
    assert _ask(port, "GET", "/healthz", Cookie="a=\u20ac".encode().decode("latin-1")) == 200
    assert _ask(port, "POST", f"/push/{token}", b"x" * (1024 * 1024 + 1)) in (413, 0)
    assert _ask(port, "POST", f"/push%252F{token}", b"x") == 404
    assert _ask(port, "POST", f"/push/{token}", b"up") == 201
    nginx_in_front.web.stop()
    for path in (f"/push/{token}", f"/push//{token}", f"/%70ush/{token}",
                 f"/push%252F{token}", f"/push/message/{payload}"):  # fmt: skip
        assert _ask(port, "POST", path, b"down") == 502, path
    access_log = nginx_in_front.log
    wait_until(lambda: access_log.exists() and access_log.read_text().count("\n") >= 9)
    written = {
        path.name: path.read_bytes().decode("latin-1")
        for path in folder.rglob("*")
        if path.is_file() and path.suffix == ".log"
    }
    assert set(written) >= {"access.log", "error.log"}, sorted(written)
    pieces = [payload[i : i + 16] for i in range(0, len(payload) - 15, 8)]
    leaks = {name: [p for p in pieces if p in text] for name, text in written.items()}
    assert not any(leaks.values()), {name: written[name][-2000:] for name in leaks if leaks[name]}
    # Each of them is in the access log, masked, with what happened.
    logged = written["access.log"]
    assert '"POST /push/... HTTP/1.1" 413' in logged, logged
    assert logged.count("upstream=502") == 5, logged
    assert '"POST /push/... HTTP/1.1" 502' in logged and '"POST /... HTTP/1.1" 502' in logged
