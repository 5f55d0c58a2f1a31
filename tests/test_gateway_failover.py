"""Two gateways share the component links of a real Prosody; one dies, the other takes over.

Three push components are spread over two gateway processes by their leases
(relay/services/link_leases.py). A publisher (a fourth component on the same Prosody, playing
the users' server) publishes to all three at a steady rate while one gateway is killed with
SIGKILL, or stopped with SIGTERM. Every publish answered `result` must reach the fake FCM (or
become a dead letter): a `result` means the push is in the broker, whichever gateway said
it. The dead gateway's links must come back on the survivor: after a kill once its leases
expired (RELAY_GATEWAY_LEASE_SECONDS), after SIGTERM at once, since it released them. The
times are printed; only a generous bound is asserted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field

import pytest

from relay.models import (
    App,
    Component,
    ComponentLink,
    DeadLetter,
    LinkLease,
    Registration,
    Service,
    Tenant,
)
from tests.fakes.fcm import FakeFcm
from tests.support.processes import ServiceProcess, start_gateway, start_worker
from tests.support.provider_fakes import configure
from tests.support.waiting import wait_until
from tests.support.xmpp_client import RawXmppStream

pytestmark = [pytest.mark.peers, pytest.mark.django_db(transaction=True)]

PUSH_COMPONENTS = [(f"push{i}.localhost", f"push-secret-{i}-0123456789") for i in (1, 2, 3)]
PUBLISHER = ("pub.localhost", "publisher-secret-0123456789")
LEASE_SECONDS = 5
RENEW_SECONDS = 1
PUBLISH_INTERVAL = 0.05  # 20 publishes a second, over the three components
PER_COMPONENT = 500  # registrations (one per publish) made for each component
RECOVERY_BOUND = 30.0
ACCEPT_NS = "jabber:component:accept"

PUBLISH = (
    "<iq type='set' from='pub.localhost' to='{to}' id='{id}'>"
    "<pubsub xmlns='http://jabber.org/protocol/pubsub'><publish node='{node}'><item>"
    "<notification xmlns='urn:xmpp:push:0'><x xmlns='jabber:x:data' type='form'>"
    "<field var='FORM_TYPE' type='hidden'><value>urn:xmpp:push:summary</value></field>"
    "<field var='message-count'><value>1</value></field></x></notification></item></publish>"
    "<publish-options><x xmlns='jabber:x:data' type='submit'><field var='FORM_TYPE'>"
    "<value>http://jabber.org/protocol/pubsub#publish-options</value></field>"
    "<field var='secret'><value>secret</value></field></x></publish-options></pubsub></iq>"
)


@dataclass
class Sent:
    component: str
    token: str
    at: float
    answer: str = ""  # "result", an error condition, or "" (none yet)


@dataclass
class Publisher:
    """The users' server: one publish per registration, round robin over the components."""

    stream: RawXmppStream
    nodes: dict[str, list[tuple[str, str]]]  # component jid -> [(node, token)]
    sent: dict[str, Sent] = field(default_factory=dict)
    _next: int = 0

    @classmethod
    def connect(cls, port: int, nodes: dict[str, list[tuple[str, str]]]) -> Publisher:
        stream = RawXmppStream("127.0.0.1", port)
        stream.open(PUBLISHER[0], ACCEPT_NS, version=False)
        digest = hashlib.sha1((stream.stream_id + PUBLISHER[1]).encode()).hexdigest()
        stream.send(f"<handshake>{digest}</handshake>")
        reply = stream.read_element()
        assert reply.tag.endswith("handshake"), reply
        return cls(stream, {jid: list(reversed(pairs)) for jid, pairs in nodes.items()})

    def run_for(self, seconds: float) -> None:
        """Publish every PUBLISH_INTERVAL and read answers in between, for `seconds`."""
        end = time.monotonic() + seconds
        next_send = time.monotonic()
        jids = list(self.nodes)
        while (now := time.monotonic()) < end:
            if now >= next_send:
                jid = jids[self._next % len(jids)]
                self._next += 1
                if self.nodes[jid]:
                    node, token = self.nodes[jid].pop()
                    iq_id = f"p{self._next}"
                    self.sent[iq_id] = Sent(jid, token, now)
                    self.stream.send(PUBLISH.format(to=jid, id=iq_id, node=node))
                next_send += PUBLISH_INTERVAL
            self._read(max(0.001, min(next_send, end) - time.monotonic()))

    def _read(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            element = self.stream.read_element(timeout)
            entry = self.sent.get(element.get("id", ""))
            if entry is not None and element.tag == f"{{{ACCEPT_NS}}}iq":
                if element.get("type") == "result":
                    entry.answer = "result"
                else:
                    error = element.find(f"{{{ACCEPT_NS}}}error")
                    entry.answer = (
                        error[0].tag.split("}")[1] if error is not None and len(error) else "error"
                    )

    def first_result_after(self, jid: str, moment: float) -> float | None:
        """When the first publish sent after `moment` that was answered `result` was sent."""
        results = [
            s.at for s in self.sent.values()
            if s.component == jid and s.at > moment and s.answer == "result"
        ]  # fmt: skip
        return min(results) if results else None


def make_relay(prosody_port: int, fake: FakeFcm) -> dict[str, list[tuple[str, str]]]:
    tenant = Tenant.objects.create(name="failover")
    app = App.objects.create(
        tenant=tenant,
        name="conversations",
    )
    configure(app, "fcm", service_account=json.dumps(fake.service_account()), endpoint=fake.url)
    nodes: dict[str, list[tuple[str, str]]] = {}
    for jid, secret in PUSH_COMPONENTS:
        component = Component.objects.create(
            tenant=tenant, app=app, jid=jid, secret=secret, host="127.0.0.1", port=prosody_port
        )
        pairs = [(f"{jid}-node-{i}", f"{jid}-token-{i}") for i in range(PER_COMPONENT)]
        Registration.objects.bulk_create(
            Registration(
                app=app,
                component=component,
                service=Service.FCM,
                device_hash=hashlib.sha1(node.encode()).hexdigest(),
                account_domain=PUBLISHER[0],
                token=token,
                node=node,
                secret="secret",
            )
            for node, token in pairs
        )
        nodes[jid] = pairs
    return nodes


def gateway(name: str) -> ServiceProcess:
    return start_gateway(
        RELAY_GATEWAY_NAME=name,
        RELAY_GATEWAY_LEASE_SECONDS=str(LEASE_SECONDS),
        RELAY_GATEWAY_RENEW_SECONDS=str(RENEW_SECONDS),
        RELAY_COALESCE_SECONDS="0",
    )


def holders() -> dict[str, str]:
    """Component jid -> the name its lease holder was started with ("" if none)."""
    return {
        lease.component.jid: lease.holder.split("/")[0]
        for lease in LinkLease.objects.select_related("component")
    }


def all_up_and_spread() -> bool:
    held = holders()
    up = ComponentLink.objects.filter(state="up").count()
    return up == len(PUSH_COMPONENTS) and set(held.values()) == {"gw-a", "gw-b"}


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_the_survivor_takes_the_links_over_and_no_accepted_publish_is_lost(
    xmpp_server_factory, how
):
    prosody = xmpp_server_factory("prosody", [*PUSH_COMPONENTS, PUBLISHER])
    with FakeFcm() as fake:
        nodes = make_relay(prosody.component_port, fake)
        worker = start_worker(RELAY_COALESCE_SECONDS="0")
        a = gateway("gw-a")
        wait_until(lambda: ComponentLink.objects.filter(state="up").count() == 3, timeout=120)
        b = gateway("gw-b")  # a holds all three: it gives one up for b
        processes = [worker, a, b]
        try:
            wait_until(all_up_and_spread, timeout=120, interval=0.2)
            victim_links = [jid for jid, holder in holders().items() if holder == "gw-a"]
            publisher = Publisher.connect(prosody.component_port, nodes)
            publisher.run_for(3.0)

            stopped_at = time.monotonic()
            if how == "SIGKILL":
                a.kill()
            else:
                assert a.stop() == 0, a.log_text()[-3000:]
                # Released on the way out: nothing is left for its leases to run out.
                assert "gw-a" not in holders().values()
            stop_took = time.monotonic() - stopped_at

            recovered: dict[str, float] = {}
            deadline = stopped_at + RECOVERY_BOUND + 5
            while len(recovered) < len(victim_links) and time.monotonic() < deadline:
                publisher.run_for(0.5)
                for jid in victim_links:
                    first = publisher.first_result_after(jid, stopped_at + stop_took)
                    if first is not None and jid not in recovered:
                        recovered[jid] = first - stopped_at
            publisher.run_for(2.0)  # the survivor serves all three for a while
            survivor_holds = holders()
            publisher.stream.close()

            accepted = {s.token for s in publisher.sent.values() if s.answer == "result"}

            def all_delivered() -> bool:
                at_fcm = {request.token for request in fake.requests}
                dead = set(DeadLetter.objects.values_list("registration__token", flat=True))
                return accepted <= at_fcm | dead

            with contextlib.suppress(TimeoutError):  # the assertion below says what is missing
                wait_until(all_delivered, timeout=60, interval=0.5)
        finally:
            for process in processes:
                process.stop()
            logs = "\n".join(process.log_text()[-2000:] for process in processes)

    at_fcm = {request.token for request in fake.requests}
    dead = set(DeadLetter.objects.values_list("registration__token", flat=True))
    lost = accepted - at_fcm - dead
    answers = [s.answer for s in publisher.sent.values()]
    print(
        f"\ngateway failover ({how}): {len(victim_links)} of 3 links moved;"
        f" back after {', '.join(f'{t:.1f}s' for t in sorted(recovered.values()))}"
        f" (the stop itself took {stop_took:.1f}s); {len(answers)} publishes,"
        f" {answers.count('result')} answered result, {len(lost)} of those lost,"
        f" {len(dead & accepted)} dead letters"
    )
    assert victim_links, "gw-a held no link"
    assert not lost, f"{len(lost)} accepted publishes never reached FCM\n{logs}"
    assert set(recovered) == set(victim_links), f"links not back: {recovered}\n{logs}"
    assert max(recovered.values()) < RECOVERY_BOUND
    assert set(survivor_holds.values()) == {"gw-b"}
    # The publisher kept going throughout: most publishes were accepted.
    assert answers.count("result") > len(answers) / 2
    if how == "SIGTERM":
        # Released, not expired: the survivor took over before a lease could have run out.
        assert max(recovered.values()) - stop_took < LEASE_SECONDS
