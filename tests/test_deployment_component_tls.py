"""docs/production.md, "TLS for the component link": "ejabberd can listen with TLS on its
service port, and slixmpp's ComponentXMPP completes the XEP-0114 handshake over it". This holds
that claim against a real ejabberd 23.01 and slixmpp 1.17, with the knobs a per-component TLS
option of the gateway would set (it has none yet: docs/production.md says so). If a slixmpp
upgrade moves these knobs, this fails before anyone builds on them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from slixmpp import ComponentXMPP

from tests.fakes.apns import CertificateAuthority, _server_certificate
from tests.support.ports import LOOPBACK
from tests.support.xmpp_servers import EjabberdServer

JID, SECRET = "push.localhost", "s3cr3t"


class TlsServiceEjabberd(EjabberdServer):
    """ejabberd whose component listener speaks TLS from the first byte (`tls: true`)."""

    def __init__(self, certfile: Path, **options: Any) -> None:
        super().__init__([(JID, SECRET)], **options)
        self.certfile = certfile

    def render_config(self) -> dict[str, Any]:
        config = super().render_config()
        config["certfiles"] = [str(self.certfile)]
        for listener in config["listen"]:
            if listener["module"] == "ejabberd_service":
                listener["tls"] = True
                listener["certfile"] = str(self.certfile)
        return config

    def _ready_markers(self) -> list[str]:
        tcp = f"TCP connections at {LOOPBACK}:{self.component_port} "
        tls = f"TLS connections at {LOOPBACK}:{self.component_port} "
        return [marker.replace(tcp, tls) for marker in super()._ready_markers()]

    @property
    def component_port(self) -> int:
        return self._component_port


@pytest.fixture(scope="module")
def tls_ejabberd(tmp_path_factory):
    if not EjabberdServer.available():
        pytest.fail("ejabberd is not installed (run `make test` as root to install it)")
    folder = tmp_path_factory.mktemp("ejabberd-tls")
    authority = CertificateAuthority.create("Component link CA")
    certificate, key = _server_certificate(authority, LOOPBACK)  # names localhost and 127.0.0.1
    (folder / "server.pem").write_text(certificate + key)
    (folder / "ca.pem").write_text(authority.pem)
    (folder / "other-ca.pem").write_text(CertificateAuthority.create("Someone else").pem)
    server = TlsServiceEjabberd(folder / "server.pem", workdir=folder / "server")
    server.start()
    try:
        yield server, folder
    finally:
        server.close()


def handshake(port: int, *, tls: bool, ca_file: Path | None = None) -> tuple[str, str | None]:
    """Connect a ComponentXMPP; returns how it ended and the TLS version it used."""

    async def attempt() -> tuple[str, str | None]:
        xmpp = ComponentXMPP(JID, SECRET, "localhost", port)
        if tls:
            # Direct TLS on the component port: slixmpp tries the "services" in tls_services
            # with TLS (the host's name for SNI and verification) and plain TCP only if allowed.
            xmpp.tls_services = {"xmpps-component"}
            xmpp.enable_direct_tls = True
            xmpp.enable_plaintext = False
            xmpp.ca_certs = str(ca_file) if ca_file else None
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def finish(result: str) -> None:
            if not outcome.done():
                outcome.set_result(result)

        xmpp.add_event_handler("session_start", lambda _: finish("session"))
        xmpp.add_event_handler("disconnected", lambda _: finish("disconnected"))
        xmpp.add_event_handler("connection_failed", lambda error: finish(f"failed: {error!r}"))
        xmpp.connect()
        try:
            result = await asyncio.wait_for(outcome, 15)
        except TimeoutError:
            result = "timeout"
        ssl_object = xmpp.transport.get_extra_info("ssl_object") if xmpp.transport else None
        version = ssl_object.version() if ssl_object else None
        xmpp.abort()
        return result, version

    return asyncio.run(attempt())


def test_a_component_completes_the_handshake_over_direct_tls(tls_ejabberd):
    server, folder = tls_ejabberd
    result, version = handshake(server.component_port, tls=True, ca_file=folder / "ca.pem")
    assert result == "session"
    assert version in ("TLSv1.2", "TLSv1.3")


def test_the_server_certificate_is_verified(tls_ejabberd):
    server, folder = tls_ejabberd
    result, _ = handshake(server.component_port, tls=True, ca_file=folder / "other-ca.pem")
    assert result.startswith("failed:"), result
    assert "CERTIFICATE_VERIFY_FAILED" in result


def test_the_tls_listener_refuses_a_plaintext_component(tls_ejabberd):
    server, _ = tls_ejabberd
    result, version = handshake(server.component_port, tls=False)
    assert result != "session" and version is None
