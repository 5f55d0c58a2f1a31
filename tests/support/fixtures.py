"""pytest fixtures for tests against real XMPP servers (Prosody and ejabberd).

Load with ``pytest_plugins = ["tests.support.fixtures"]`` (tests/conftest.py does).

Session-scoped servers, started on first use and stopped at the end of the session:

- ``prosody``, ``ejabberd``: one server each with the components of ``peer_components``
  (default ``[("push.localhost", "s3cr3t")]``). Other components for some tests::

      @pytest.mark.parametrize("prosody", [[("a.localhost", "x"), ("b.localhost", "y")]],
                               indirect=True)

- ``xmpp_server``: parametrized over both, for tests that must pass with each server.

Function-scoped factories, cleaned up after the test:

- ``xmpp_server_factory(kind, components=..., **options)``: a private server, e.g. with
  ``push_max_errors=1`` or to ``restart()``/``stop()`` without disturbing other tests.
- ``xmpp_client_factory(server, prefix="user", connect=True, **kwargs)``: registers a fresh
  account and returns its ``XmppTestClient``.

Servers that are not installed make the tests that need them fail (never skip).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.support.xmpp_client import XmppTestClient
from tests.support.xmpp_servers import (
    DEFAULT_COMPONENTS,
    Component,
    EjabberdServer,
    ProsodyServer,
    XmppServer,
)

ServerKind = Literal["prosody", "ejabberd"]
SERVER_CLASSES: dict[str, type[XmppServer]] = {
    "prosody": ProsodyServer,
    "ejabberd": EjabberdServer,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "peers: needs the real Prosody/ejabberd binaries")


def _require(server_class: type[XmppServer]) -> None:
    # A missing server is a broken test machine, not a reason to pass: `make test` installs them.
    if not server_class.available():
        pytest.fail(f"{server_class.kind} is not installed (run `make test` as root to install it)")


def _start_session_server(
    kind: ServerKind,
    request: pytest.FixtureRequest,
    components: Sequence[Component],
    tmp_path_factory: pytest.TempPathFactory,
) -> XmppServer:
    server_class = SERVER_CLASSES[kind]
    _require(server_class)
    server = server_class(
        getattr(request, "param", None) or components, workdir=tmp_path_factory.mktemp(kind)
    )
    try:
        server.start()
    except BaseException:
        server.close()
        raise
    return server


@pytest.fixture(scope="session")
def peer_components() -> list[Component]:
    """Components of the session servers; override (session scope) in a conftest."""
    return list(DEFAULT_COMPONENTS)


@pytest.fixture(scope="session")
def prosody(
    request: pytest.FixtureRequest,
    peer_components: list[Component],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ProsodyServer]:
    """A Prosody shared by the session (indirect parametrization: a component list)."""
    server = _start_session_server("prosody", request, peer_components, tmp_path_factory)
    assert isinstance(server, ProsodyServer)
    yield server
    server.close()


@pytest.fixture(scope="session")
def ejabberd(
    request: pytest.FixtureRequest,
    peer_components: list[Component],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EjabberdServer]:
    """An ejabberd shared by the session (indirect parametrization: a component list)."""
    server = _start_session_server("ejabberd", request, peer_components, tmp_path_factory)
    assert isinstance(server, EjabberdServer)
    yield server
    server.close()


@pytest.fixture(params=["prosody", "ejabberd"])
def xmpp_server(request: pytest.FixtureRequest) -> XmppServer:
    """Each session server in turn."""
    server = request.getfixturevalue(request.param)
    assert isinstance(server, XmppServer)
    return server


@pytest.fixture
def xmpp_server_factory(tmp_path: Path) -> Iterator[Callable[..., XmppServer]]:
    """Start private servers: ``factory("prosody", components, push_max_errors=1)``."""
    started: list[XmppServer] = []

    def start(
        kind: ServerKind,
        components: Sequence[Component] = DEFAULT_COMPONENTS,
        **options: Any,
    ) -> XmppServer:
        server_class = SERVER_CLASSES[kind]
        _require(server_class)
        server = server_class(components, workdir=tmp_path / f"{kind}-{len(started)}", **options)
        started.append(server)
        server.start()
        return server

    yield start
    for server in reversed(started):
        server.close()


@pytest.fixture
def xmpp_client_factory() -> Iterator[Callable[..., XmppTestClient]]:
    """Fresh accounts: ``factory(server, "alice")`` registers and connects a client."""
    clients: list[XmppTestClient] = []

    def make(
        server: XmppServer, prefix: str = "user", *, connect: bool = True, **kwargs: Any
    ) -> XmppTestClient:
        client = XmppTestClient.with_new_account(server, prefix, connect=connect, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in reversed(clients):
        client.close()
