"""The real-peer harness works with both Prosody and ejabberd.

Run alone with: ``.venv/bin/python -m pytest tests/test_peers_harness.py -q -p no:django``.
"""

from __future__ import annotations

import hashlib
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.ports import free_port, port_accepts
from tests.support.xmpp_client import (
    COMMANDS_NS,
    COMPONENT_NS,
    DATA_FORMS_NS,
    PUSH_NS,
    STREAM_NS,
    RawXmppStream,
    RegistrationError,
    XmppTestClient,
    error_condition,
    form_values,
    message_body,
    new_username,
    register_account,
)
from tests.support.xmpp_servers import ProsodyServer, ServerStartError, XmppServer

pytestmark = pytest.mark.peers

ClientFactory = Callable[..., XmppTestClient]
ServerFactory = Callable[..., XmppServer]
PUBSUB_NS = "http://jabber.org/protocol/pubsub"
IQ = f"{{{COMPONENT_NS}}}iq"


def text(element: ET.Element) -> str:
    return ET.tostring(element, encoding="unicode")


def open_component(server: XmppServer, jid: str, secret: str) -> tuple[RawXmppStream, ET.Element]:
    """XEP-0114 by hand: stream header, then ``<handshake>`` = hex(sha1(stream id + secret))."""
    stream = RawXmppStream(server.host, server.component_port, timeout=5)
    try:
        header = stream.open(jid, COMPONENT_NS, version=False)
        assert header.tag == f"{{{STREAM_NS}}}stream"
        assert stream.stream_id
        digest = hashlib.sha1((stream.stream_id + secret).encode()).hexdigest()
        stream.send(f"<handshake>{digest}</handshake>")
        return stream, stream.read_element()
    except BaseException:
        stream.close()
        raise


def assert_handshake_accepted(reply: ET.Element) -> None:
    assert reply.tag == f"{{{COMPONENT_NS}}}handshake", text(reply)


def assert_stream_error(reply: ET.Element, condition: str) -> None:
    assert reply.tag == f"{{{STREAM_NS}}}error", text(reply)
    assert error_condition(reply) == condition, text(reply)


# --------------------------------------------------------------------------- clients
def test_two_fresh_users_exchange_a_message(
    xmpp_server: XmppServer, xmpp_client_factory: ClientFactory
) -> None:
    alice = xmpp_client_factory(xmpp_server, "alice")
    bob = xmpp_client_factory(xmpp_server, "bob")
    assert alice.bare_jid.endswith("@localhost")
    assert bob.full_jid.startswith(f"{bob.bare_jid}/")
    assert alice.sm_enabled and bob.sm_enabled

    alice.send_message(bob.bare_jid, "hello bob")

    message = bob.wait_for_message(timeout=5)
    assert message_body(message) == "hello bob"
    assert message.get("from", "").startswith(f"{alice.bare_jid}/")


def test_registration_of_a_taken_name_is_refused(xmpp_server: XmppServer) -> None:
    username = new_username("taken")
    register_account(xmpp_server, username, "first-password")
    with pytest.raises(RegistrationError) as refused:
        register_account(xmpp_server, username, "second-password")
    assert refused.value.reply is not None
    assert error_condition(refused.value.reply) == "conflict"


def test_error_replies_are_returned_not_raised(
    xmpp_server: XmppServer, xmpp_client_factory: ClientFactory
) -> None:
    client = xmpp_client_factory(xmpp_server)
    reply = client.send_iq("<iq type='get'><query xmlns='urn:example:unknown'/></iq>")
    assert reply.get("type") == "error", text(reply)
    assert error_condition(reply) in {"service-unavailable", "feature-not-implemented"}
    assert client.ping().get("type") == "result"


def test_push_enable_is_accepted_without_a_connected_component(
    xmpp_server: XmppServer, xmpp_client_factory: ClientFactory
) -> None:
    """Both servers store an ``<enable>`` without asking the component."""
    client = xmpp_client_factory(xmpp_server)
    component_jid, _ = xmpp_server.components[0]

    reply = client.enable_push(component_jid, "node-1", secret="push-secret")
    assert reply.get("type") == "result", text(reply)

    reply = client.disable_push(component_jid, "node-1")
    assert reply.get("type") == "result", text(reply)


def test_abort_leaves_a_hibernated_session_that_resumes(
    xmpp_server: XmppServer, xmpp_client_factory: ClientFactory
) -> None:
    alice = xmpp_client_factory(xmpp_server, "alice")
    bob = xmpp_client_factory(xmpp_server, "bob")

    bob.abort()
    assert not bob.is_connected
    alice.send_message(bob.bare_jid, "while you were away")

    assert bob.connect() == "resumed"
    assert message_body(bob.wait_for_message(timeout=5)) == "while you were away"

    bob.disconnect()
    assert bob.connect() == "started"  # a clean disconnect ends the session


# --------------------------------------------------------------------------- components
def test_component_handshake_with_the_right_secret(xmpp_server: XmppServer) -> None:
    jid, secret = xmpp_server.components[0]
    stream, reply = open_component(xmpp_server, jid, secret)
    with stream:
        assert_handshake_accepted(reply)


def test_component_handshake_with_a_wrong_secret(xmpp_server: XmppServer) -> None:
    jid, _ = xmpp_server.components[0]
    stream, reply = open_component(xmpp_server, jid, "wrong-secret")
    with stream:
        assert_stream_error(reply, "not-authorized")


def test_second_connection_of_a_component(xmpp_server: XmppServer) -> None:
    """Prosody refuses a second connection for the same component; ejabberd accepts it."""
    jid, secret = xmpp_server.components[0]
    first, reply = open_component(xmpp_server, jid, secret)
    with first:
        assert_handshake_accepted(reply)
        second, reply = open_component(xmpp_server, jid, secret)
        with second:
            if isinstance(xmpp_server, ProsodyServer):
                assert_stream_error(reply, "conflict")
            else:
                assert_handshake_accepted(reply)


def test_ad_hoc_command_reaches_a_raw_component(
    xmpp_server: XmppServer, xmpp_client_factory: ClientFactory
) -> None:
    """XEP-0050 in one step, the way Conversations registers with an app server."""
    jid, secret = xmpp_server.components[0]
    client = xmpp_client_factory(xmpp_server)
    component, reply = open_component(xmpp_server, jid, secret)
    with component, ThreadPoolExecutor(1) as background:
        assert_handshake_accepted(reply)
        fields = {"token": "t1", "android-id": "a1", "empty": None}
        answer = background.submit(client.execute_command, jid, "register-push-fcm", fields)

        request = component.read_until(lambda element: element.tag == IQ)
        assert (request.get("type"), request.get("from")) == ("set", client.full_jid)
        command = request.find(f"{{{COMMANDS_NS}}}command")
        assert command is not None, text(request)
        assert (command.get("node"), command.get("action")) == ("register-push-fcm", "execute")
        form = command.find(f"{{{DATA_FORMS_NS}}}x")
        assert form is not None and form.get("type") == "submit", text(request)
        assert form_values(command) == {"token": ["t1"], "android-id": ["a1"], "empty": []}
        component.send(
            f"<iq type='result' id='{request.get('id')}' from='{jid}' to='{client.full_jid}'>"
            f"<command xmlns='{COMMANDS_NS}' node='register-push-fcm' status='completed'/></iq>"
        )
        assert answer.result(5).get("type") == "result"


def test_message_to_a_hibernated_user_makes_the_server_publish(
    xmpp_server: XmppServer, xmpp_client_factory: ClientFactory
) -> None:
    """XEP-0357: enable, drop the TCP connection, get a message: a publish to the component."""
    jid, secret = xmpp_server.components[0]
    alice = xmpp_client_factory(xmpp_server, "alice")
    bob = xmpp_client_factory(xmpp_server, "bob")
    component, reply = open_component(xmpp_server, jid, secret)
    with component:
        assert_handshake_accepted(reply)
        assert bob.enable_push(jid, "bob-node", secret="bob-secret").get("type") == "result"
        bob.abort()
        alice.send_message(bob.bare_jid, "wake up")

        # Prosody waits 1 s to batch pushes of a hibernated session; ejabberd pushes at once.
        publish = component.read_until(lambda element: element.tag == IQ, timeout=10)
        assert publish.get("type") == "set", text(publish)
        assert publish.get("from") == xmpp_server.domain  # both servers publish as the host
        pubsub = publish.find(f"{{{PUBSUB_NS}}}pubsub")
        assert pubsub is not None, text(publish)
        item = pubsub.find(f"{{{PUBSUB_NS}}}publish")
        assert item is not None and item.get("node") == "bob-node", text(publish)
        assert item.find(f".//{{{PUSH_NS}}}notification") is not None, text(publish)
        options = pubsub.find(f"{{{PUBSUB_NS}}}publish-options")
        assert options is not None, text(publish)
        assert form_values(options)["secret"] == ["bob-secret"]
        component.send(f"<iq type='result' id='{publish.get('id')}' from='{jid}' to='localhost'/>")

    assert bob.connect() == "resumed"
    assert message_body(bob.wait_for_message(timeout=5)) == "wake up"


# --------------------------------------------------------------------------- servers
@pytest.mark.parametrize("kind", ["prosody", "ejabberd"])
def test_several_components_and_restart(kind: str, xmpp_server_factory: ServerFactory) -> None:
    components = [("push.localhost", "s3cr3t"), ("other.localhost", "another-secret")]
    server = xmpp_server_factory(kind, components)
    assert server.domain == "localhost"
    username, password = new_username(), "pw"
    register_account(server, username, password)
    for jid, secret in components:
        stream, reply = open_component(server, jid, secret)
        with stream:
            assert_handshake_accepted(reply)
    stream, reply = open_component(server, "other.localhost", "s3cr3t")
    with stream:
        assert_stream_error(reply, "not-authorized")

    ports = (server.c2s_port, server.component_port)
    server.restart()
    assert (server.c2s_port, server.component_port) == ports
    with XmppTestClient(server, username, password) as client:  # the account survived
        assert client.connect() == "started"

    server.stop(graceful=False)  # restart() did the graceful SIGTERM stop already
    assert not server.is_running
    assert not port_accepts(server.c2s_port)


@pytest.mark.parametrize(
    "prosody", [[("a.localhost", "secret-a"), ("b.localhost", "secret-b")]], indirect=True
)
def test_session_server_with_other_components(prosody: ProsodyServer) -> None:
    assert [jid for jid, _ in prosody.components] == ["a.localhost", "b.localhost"]
    stream, reply = open_component(prosody, "b.localhost", "secret-b")
    with stream:
        assert_handshake_accepted(reply)


def test_prosody_push_max_errors(
    xmpp_server_factory: ServerFactory, xmpp_client_factory: ClientFactory
) -> None:
    """With push_max_errors=1, one error reply to a push disables the registration."""
    server = xmpp_server_factory("prosody", push_max_errors=1)
    jid, secret = server.components[0]
    alice = xmpp_client_factory(server, "alice")
    bob = xmpp_client_factory(server, "bob")
    component, reply = open_component(server, jid, secret)
    with component:
        assert_handshake_accepted(reply)
        assert bob.enable_push(jid, "bob-node").get("type") == "result"
        bob.abort()
        alice.send_message(bob.bare_jid, "wake up")
        publish = component.read_until(lambda element: element.tag == IQ, timeout=10)
        component.send(
            f"<iq type='error' id='{publish.get('id')}' from='{jid}' to='localhost'>"
            "<error type='cancel'><item-not-found xmlns='urn:ietf:params:xml:ns:xmpp-stanzas'/>"
            "</error></iq>"
        )
        server.wait_for_log("Disabling push notifications for identifier")


def test_a_taken_port_fails_fast_with_the_log(tmp_path: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        server = ProsodyServer(workdir=tmp_path, c2s_port=taken, component_port=free_port())
        started = time.monotonic()
        with pytest.raises(ServerStartError, match="already in use"):
            server.start()
        # Well before the start-up deadline it would otherwise wait out.
        assert time.monotonic() - started < server.startup_timeout / 2
        assert not server.is_running
