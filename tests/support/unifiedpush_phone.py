"""A UnifiedPush distributor phone (what Conversations does) and the apps behind it.

`Phone` is an `XmppTestClient` that registers endpoints with a component over its server
(`<register xmlns='http://gultsch.de/xmpp/drafts/unified-push'>`), receives `<push>` iqs,
and answers them as the test says: `result`, an error condition (`item-not-found`,
`service-unavailable`, ...), or nothing. Each endpoint carries the Web Push keys an app would
create (RFC 8291), so a test can POST with `pywebpush` and decrypt on the phone with `http_ece`.
"""

from __future__ import annotations

import base64
import copy
import os
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

import http_ece
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from slixmpp.xmlstream.handler import Callback
from slixmpp.xmlstream.matcher import MatchXPath

from tests.support.xmpp_client import CLIENT_NS, XmppTestClient

UP_NS = "http://gultsch.de/xmpp/drafts/unified-push"
STANZAS_NS = "urn:ietf:params:xml:ns:xmpp-stanzas"


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@dataclass
class WebPushKeys:
    """An app's subscription keys: the P-256 key pair and the auth secret."""

    private_key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )
    auth: bytes = field(default_factory=lambda: os.urandom(16))

    @property
    def p256dh(self) -> str:
        raw = self.private_key.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
        return b64url(raw)

    def subscription(self, endpoint: str) -> dict[str, Any]:
        return {"endpoint": endpoint, "keys": {"p256dh": self.p256dh, "auth": b64url(self.auth)}}

    def decrypt(self, body: bytes) -> bytes:
        return http_ece.decrypt(
            body, private_key=self.private_key, auth_secret=self.auth, version="aes128gcm"
        )


@dataclass
class Endpoint:
    url: str
    expiration: str
    application: str
    instance: str
    keys: WebPushKeys = field(default_factory=WebPushKeys)


@dataclass(frozen=True)
class Push:
    iq_id: str
    sender: str
    application: str
    instance: str
    body: bytes
    received: float


class Phone(XmppTestClient):
    """A distributor: registers endpoints, receives pushes, answers them as told."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.answer_with: str | None = "result"  # an error condition, or None for silence
        self.pushes: list[Push] = []
        self._pushes_changed = threading.Condition()
        super().__init__(*args, **kwargs)

    async def _create(self, resource: str) -> Any:
        xmpp = await super()._create(resource)
        xmpp.register_handler(
            Callback("up push", MatchXPath(f"{{{CLIENT_NS}}}iq/{{{UP_NS}}}push"), self._on_push)
        )
        return xmpp

    def _on_push(self, iq: Any) -> None:
        element = iq.xml.find(f"{{{UP_NS}}}push")
        push = Push(
            iq_id=iq["id"],
            sender=str(iq["from"]),
            application=element.get("application", ""),
            instance=element.get("instance", ""),
            body=base64.b64decode(element.text or ""),
            received=time.monotonic(),
        )
        answer = self.answer_with
        if answer == "result":
            iq.reply(clear=True).send()
        elif answer is not None:
            reply = iq.reply(clear=True)
            reply["type"] = "error"
            reply["error"]["type"] = "cancel"
            reply["error"]["condition"] = answer
            reply.send()
        with self._pushes_changed:
            self.pushes.append(push)
            self._pushes_changed.notify_all()

    def register_endpoint(
        self, component_jid: str, *, application: str | None = None, instance: str | None = None
    ) -> Endpoint:
        application = application or base64.b64encode(os.urandom(32)).decode()
        instance = instance or base64.b64encode(os.urandom(32)).decode()
        reply = self.register_raw(component_jid, application, instance)
        registered = reply.find(f"{{{UP_NS}}}registered")
        if reply.get("type") != "result" or registered is None:
            raise AssertionError(f"registration refused: {ET.tostring(reply).decode()}")
        return Endpoint(
            registered.get("endpoint", ""), registered.get("expiration", ""), application, instance
        )

    def register_raw(self, component_jid: str, application: str, instance: str) -> ET.Element:
        iq = ET.Element(f"{{{CLIENT_NS}}}iq", {"type": "set", "to": component_jid})
        ET.SubElement(
            iq, f"{{{UP_NS}}}register", {"application": application, "instance": instance}
        )
        return self.send_iq(iq)

    def announce(self, component_jid: str) -> None:
        """Directed presence to the push server, as Conversations sends after binding."""
        self._run(self._announce(component_jid), self.timeout)

    async def _announce(self, component_jid: str) -> None:
        self._xmpp.send_presence(pto=component_jid)
        await self._xmpp.waiting_queue.join()

    def wait_for_pushes(self, count: int, timeout: float = 60.0) -> list[Push]:
        deadline = time.monotonic() + timeout
        with self._pushes_changed:
            while len(self.pushes) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{len(self.pushes)} of {count} pushes in {timeout} s")
                self._pushes_changed.wait(remaining)
            return list(self.pushes)

    def pushes_now(self) -> list[Push]:
        with self._pushes_changed:
            return copy.copy(self.pushes)
