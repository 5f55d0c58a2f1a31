"""The TLS listener for unmodified UWPX clients (port 1997), as a real process, with a TLS client
that verifies its certificate and speaks NUL-framed JSON the way the shipped client does."""

from __future__ import annotations

import datetime
import json
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from relay.models import Registration
from relay.windows.models import WnsDevice
from tests.support.ports import free_port, port_accepts
from tests.support.processes import ROOT, ServiceProcess, service_env
from tests.support.waiting import wait_until
from tests.uwpx_examples import SEED_SET_ACCOUNTS

pytestmark = [pytest.mark.django_db(transaction=True)]

DEVICE_ID = "5486bd868050a620141f4e81c9f1d2c67ab0de27e5e26d218ca41c9394ee806b"
CHANNEL = "https://db5p.notify.windows.com/?token=AwYAAAD8sXKQxmVlUmNhQ%2bjNMKn6"
VECTOR = "e5397e96c6ff4d629ab9f203eec3ff17c777b2127cf1b41005e54877487ba982"


def write_self_signed(folder: Path, host: str = "localhost") -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "tls.pem", folder / "tls.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class UwpxClient:
    """What the shipped client does: TLS 1.2+, one JSON message plus NUL, read until NUL."""

    def __init__(self, port: int, cafile: Path) -> None:
        context = ssl.create_default_context(cafile=str(cafile))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock = context.wrap_socket(raw, server_hostname="localhost")
        self.buffer = b""

    def send(self, message: dict | str | bytes, *, terminator: bytes = b"\0") -> None:
        if isinstance(message, dict):
            message = json.dumps(message)
        data = message.encode() if isinstance(message, str) else message
        self.sock.sendall(data + terminator)

    def read(self) -> dict:
        while b"\0" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed before an answer; got {self.buffer!r}")
            self.buffer += chunk
        frame, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(frame)

    def ask(self, message: dict | str | bytes) -> dict:
        self.send(message)
        return self.read()

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except (ConnectionError, ssl.SSLError):
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def tls_files(tmp_path) -> tuple[Path, Path]:
    return write_self_signed(tmp_path)


def start_listener(app, tls_files, tmp_path, **env: str) -> tuple[ServiceProcess, int]:
    cert, key = tls_files
    port = free_port()
    var = tmp_path / "var"
    var.mkdir(exist_ok=True)
    argv = [
        sys.executable,
        "manage.py",
        "run_uwpx_listener",
        "--address",
        "127.0.0.1",
        "--port",
        str(port),
        f"--app={app.public_key}",
        "--cert",
        str(cert),
        "--key",
        str(key),
    ]
    # A folder of its own: its rate-limit counters (file cache) start empty.
    process = ServiceProcess("uwpx-listener", argv, service_env(VAR_DIR=str(var), **env))
    try:
        wait_until(lambda: port_accepts(port) or not process.alive())
    except TimeoutError:
        process.stop()
        raise
    assert process.alive(), process.log_text()
    return process, port


@pytest.fixture
def listener(component, tls_files, tmp_path) -> Iterator[tuple[ServiceProcess, int]]:
    process, port = start_listener(component.app, tls_files, tmp_path)
    yield process, port
    assert process.stop() == 0, process.log_text()


@pytest.fixture
def connect(listener, tls_files) -> Iterator:
    clients: list[UwpxClient] = []

    def make() -> UwpxClient:
        client = UwpxClient(listener[1], tls_files[0])
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def channel_message() -> dict:
    return {
        "version": 1,
        "action": "set_channel_uri",
        "device_id": DEVICE_ID,
        "channel_uri": CHANNEL,
    }


@pytest.mark.defaults
def test_registration_over_tls_as_the_shipped_client_does_it(connect, component):
    # One connection per message, as UWPX does; the shipped client names accounts by id.
    client = connect()
    assert client.ask(channel_message()) == {"version": 1, "action": "response", "status": 1}
    client = connect()
    answer = client.ask(
        {
            "version": 1,
            "action": "set_push_accounts",
            "device_id": DEVICE_ID,
            "accounts": [{"account_id": VECTOR}],
        }
    )
    assert answer["status"] == 1 and answer["push_bare_jid"] == component.jid
    [account] = answer["accounts"]
    assert account["account_id"] == VECTOR and account["success"] is True
    registration = Registration.objects.get()
    assert (registration.node, registration.secret) == (account["node"], account["secret"])
    assert registration.token == CHANNEL


@pytest.mark.defaults
def test_several_messages_on_one_connection_and_the_seed_format(connect):
    client = connect()
    assert client.ask(channel_message())["status"] == 1
    # The seed's set_accounts example, byte for byte.
    seed = SEED_SET_ACCOUNTS
    answer = client.ask(seed)
    assert answer["accounts"][0]["bare_jid"] == "someClient@xmpp.uwpx.org"
    assert answer["accounts"][0]["account_id"] == VECTOR
    # Bad input is answered and the connection stays usable.
    assert client.ask(b"{not json") == {
        "version": 1,
        "action": "response",
        "status": 0,
        "error": "Invalid JSON format.",
    }
    error = client.ask({"version": 1, "action": "request_test_push", "device_id": "ab" * 32})
    assert error["error"] == "Device id unknown."
    error = client.ask(channel_message() | {"channel_uri": "https://evil.example/"})
    assert error["status"] == 0 and "channel_uri" in error["error"]


@pytest.mark.defaults
def test_an_oversized_message_is_refused_and_the_connection_closed(connect):
    client = connect()
    client.send(b'{"version": 1, "pad": "' + b"x" * (64 * 1024), terminator=b"")
    answer = client.read()
    assert answer["status"] == 0 and "Message too large" in answer["error"]
    assert client.closed_by_server()


@pytest.mark.defaults
def test_plain_tcp_gets_no_json(listener):
    with socket.create_connection(("127.0.0.1", listener[1]), timeout=10) as sock:
        sock.sendall(json.dumps(channel_message()).encode() + b"\0")
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
    assert b"status" not in received
    assert not WnsDevice.objects.exists()


def test_test_push_over_tls_is_queued(connect, send_queue):
    client = connect()
    client.ask(channel_message())
    client.ask(
        {
            "version": 1,
            "action": "set_accounts",
            "device_id": DEVICE_ID,
            "accounts": [{"bare_jid": "a@example.org"}],
        }
    )
    answer = client.ask({"version": 1, "action": "request_test_push", "device_id": DEVICE_ID})
    assert answer == {"version": 1, "action": "response", "status": 1}
    [job] = send_queue.queued_jobs()
    assert job["registration_id"] == Registration.objects.get().pk


@pytest.mark.defaults
def test_rate_limit_per_address_on_the_listener(component, tls_files, tmp_path):
    process, port = start_listener(
        component.app, tls_files, tmp_path, RELAY_UWPX_RATE_LIMIT_ADDRESS="2/600"
    )
    try:
        client = UwpxClient(port, tls_files[0])
        assert client.ask(channel_message())["status"] == 1
        assert client.ask(b"{garbage")["error"] == "Invalid JSON format."
        assert "Too many requests" in client.ask(channel_message())["error"]
        client.close()
    finally:
        assert process.stop() == 0, process.log_text()


@pytest.mark.defaults
def test_the_command_needs_a_certificate_unless_told_to_idle(tmp_path):
    env = service_env(UWPX_TLS_CERT_FILE="", UWPX_TLS_KEY_FILE="", UWPX_LISTEN_APP="")
    failed = subprocess.run(
        [sys.executable, "manage.py", "run_uwpx_listener"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failed.returncode != 0
    assert "UWPX_TLS_CERT_FILE" in failed.stderr and "UWPX_LISTEN_APP" in failed.stderr

    idle = ServiceProcess(
        "uwpx-idle",
        [sys.executable, "manage.py", "run_uwpx_listener", "--idle-if-unconfigured"],
        env,
    )
    wait_until(lambda: "uwpx_listener.disabled" in idle.log_text() or not idle.alive(), 20)
    assert idle.alive()
    # stop() sends SIGTERM once the process handles it: sent as soon as the line is logged,
    # it could arrive before the handler is installed (status -15).
    assert idle.stop() == 0


@pytest.mark.defaults
def test_a_bad_certificate_is_a_clear_start_up_error(component, tmp_path):
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate")
    failed = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "run_uwpx_listener",
            "--app",
            component.app.public_key,
            "--cert",
            str(bogus),
            "--key",
            str(bogus),
        ],
        cwd=ROOT,
        env=service_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failed.returncode != 0
    assert "Cannot load the TLS certificate or key" in failed.stderr
