"""A loopback HTTPS fake's certificate, signed by a throw-away CA the test hands to the client
under test (its CA bundle): trusted with that bundle, refused with any other."""

from __future__ import annotations

import ssl
from pathlib import Path

from tests.fakes.apns import CertificateAuthority, _server_certificate


def loopback_tls(folder: Path, authority: str) -> tuple[ssl.SSLContext, Path]:
    """A server context for 127.0.0.1 and the bundle (written in `folder`) of the CA named
    `authority` that signed its certificate."""
    ca = CertificateAuthority.create(authority)
    cert, key = _server_certificate(ca, "127.0.0.1")
    (folder / "server.pem").write_text(cert + key)
    (folder / "ca.pem").write_text(ca.pem)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(folder / "server.pem")
    return server, folder / "ca.pem"
