"""Stanza handlers: judge the iq, call a service, turn its verdict into an answer.

Every get/set iq gets exactly one answer, and a handler never raises. A handler returns its
`Answer` at once when it can decide without a service call (a malformed, unknown or refused
request: cheap, no task, no thread), or a coroutine for the part that needs the database or
the broker; the link runs those, a bounded number at a time (xmppgateway.component). To serve
another iq, add its (iq type, payload tag) to `HANDLERS`.
"""

from __future__ import annotations

import logging
import secrets
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from slixmpp.jid import JID, InvalidJID

from relay.models import Component, Service
from relay.providers.registry import spec_for
from relay.services import channels, publishing, registrations
from xmppgateway.stanzas import (
    COMMANDS_NS,
    DATA_NS,
    DISCO_INFO_NS,
    DISCO_ITEMS_NS,
    PUBSUB_NS,
    PUSH_NS,
    BadRequest,
    form_fields,
    parse_publish,
    q,
    result_form,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
RunBlocking = Callable[..., Awaitable[Any]]
# Accepts one publish, possibly batched with others (xmppgateway.gateway.PublishBatcher).
AcceptPublish = Callable[[publishing.Publish], Awaitable[publishing.Verdict]]
# What the features announce in disco#info for a component (xmppgateway.features).
DiscoFeatures = Callable[[Component], list[str]]


def no_disco_features(component: Component) -> list[str]:
    return []


class Unavailable(Exception):
    """A blocking service call could not run (database or broker down)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """A result with an optional payload, or an error (condition, type, text)."""

    payload: ET.Element | None = None
    condition: str = ""
    error_type: str = ""
    text: str = ""

    @property
    def is_error(self) -> bool:
        return bool(self.condition)


def error(condition: str, error_type: str, text: str = "") -> Answer:
    return Answer(condition=condition, error_type=error_type, text=text)


BAD_REQUEST = "bad-request", "modify"
ITEM_NOT_FOUND = "item-not-found", "cancel"
FORBIDDEN = "forbidden", "auth"
SERVICE_UNAVAILABLE = "service-unavailable", "cancel"
TRY_LATER = "internal-server-error", "wait"
SLOW_DOWN = "resource-constraint", "wait"  # a rate limit, a cap, or a busy link
JID_MALFORMED = "jid-malformed", "modify"


@dataclass(frozen=True, slots=True)
class Command:
    action: str  # "register" or "unregister"
    service: Service


COMMANDS: dict[str, Command] = {
    f"{action}-push-{service.value}": Command(action, service)
    for action in ("register", "unregister")
    for service in Service
}
COMMAND_NAMES: dict[str, str] = {
    name: f"{command.action.capitalize()} a device for {command.service.label}"
    for name, command in COMMANDS.items()
}


@dataclass(frozen=True, slots=True)
class LinkContext:
    """What a handler knows of the link the stanza came in on."""

    component: Component
    max_field_length: int
    run_blocking: RunBlocking
    accept_publish: AcceptPublish | None = None
    # iq-set payloads by qualified tag that features serve (xmppgateway.features).
    iq_set_handlers: Mapping[str, IqHandler] = field(default_factory=dict)
    # What disco#info announces for the features on this component.
    disco_features: DiscoFeatures = no_disco_features


@dataclass(frozen=True, slots=True)
class Request:
    """A get/set iq from a sender whose address is a valid JID, with its one payload."""

    iq_type: str
    sender: JID
    payload: ET.Element


# What a handler returns: the answer, or the coroutine that will produce it.
Pending = Coroutine[Any, Any, Answer]
Outcome = Answer | Pending
Handler = Callable[[LinkContext, Request], Outcome]
# A handler for an iq-set payload a feature serves (xmppgateway.features).
IqHandler = Callable[[LinkContext, JID, ET.Element], Outcome]


# --- disco


def disco_info(ctx: LinkContext, request: Request) -> Answer:
    query = request.payload
    node = query.get("node")
    reply = ET.Element(q(DISCO_INFO_NS, "query"))
    if node:
        reply.set("node", node)
    if not node:
        ET.SubElement(
            reply,
            q(DISCO_INFO_NS, "identity"),
            {"category": "pubsub", "type": "push", "name": "Push relay"},
        )
        features = [DISCO_INFO_NS, DISCO_ITEMS_NS]
        if ctx.component.serves_p2:
            features += [PUSH_NS, COMMANDS_NS, DATA_NS]
        features += ctx.disco_features(ctx.component)
    elif node == COMMANDS_NS:
        ET.SubElement(
            reply, q(DISCO_INFO_NS, "identity"), {"category": "automation", "type": "command-list"}
        )
        features = [DISCO_INFO_NS, DISCO_ITEMS_NS]
    elif node in COMMANDS and ctx.component.serves_p2:
        ET.SubElement(
            reply,
            q(DISCO_INFO_NS, "identity"),
            {"category": "automation", "type": "command-node", "name": COMMAND_NAMES[node]},
        )
        features = [COMMANDS_NS, DATA_NS]
    else:
        return error(*ITEM_NOT_FOUND)
    for feature in features:
        ET.SubElement(reply, q(DISCO_INFO_NS, "feature"), {"var": feature})
    return Answer(reply)


def disco_items(ctx: LinkContext, request: Request) -> Answer:
    query = request.payload
    node = query.get("node")
    reply = ET.Element(q(DISCO_ITEMS_NS, "query"))
    if node:
        reply.set("node", node)
    if node == COMMANDS_NS:
        for name, description in COMMAND_NAMES.items() if ctx.component.serves_p2 else ():
            ET.SubElement(
                reply,
                q(DISCO_ITEMS_NS, "item"),
                {"jid": ctx.component.jid, "node": name, "name": description},
            )
    elif node:
        return error(*ITEM_NOT_FOUND)
    return Answer(reply)


# --- ad-hoc commands (XEP-0050), as Conversations sends them: one step, form included


def _bare_room(value: str) -> str:
    if not value:
        return ""
    try:
        room = JID(value)
    except InvalidJID as bad:
        raise BadRequest("muc is not a valid JID") from bad
    if room.resource or not room.user:
        raise BadRequest("muc must be the bare JID of a room")
    return str(room.bare)


def command(ctx: LinkContext, request: Request) -> Outcome:
    element, sender = request.payload, request.sender
    name = element.get("node", "")
    spec = COMMANDS.get(name)
    if spec is None:
        return error(*ITEM_NOT_FOUND, "unknown command")
    if not ctx.component.serves_p2:
        return error(*SERVICE_UNAVAILABLE, "this component does not serve the push commands")
    action = element.get("action", "execute")
    session_id = element.get("sessionid") or secrets.token_hex(8)
    if action == "cancel":
        return Answer(_command_reply(name, session_id, "canceled"))
    if action not in {"execute", "complete", "next"}:
        return error(*BAD_REQUEST, "unsupported action")
    if not sender.user or not sender.domain:
        return error(*BAD_REQUEST, "commands must come from an account")
    form = element.find(q(DATA_NS, "x"))
    if form is None:
        return error(*BAD_REQUEST, "a submitted form is required")
    try:
        fields = form_fields(form, max_length=ctx.max_field_length)
        room = _bare_room(fields.get("muc", "").strip())
    except BadRequest as bad:
        return error(*BAD_REQUEST, str(bad))
    device_id = (fields.get("device-id") or fields.get("android-id") or "").strip()
    if not device_id:
        return error(*BAD_REQUEST, "device-id is required")
    device = _Device(str(sender.bare), device_id, room)
    if spec.action == "register":
        try:
            # The provider's registration form (relay/providers/<name>/spec.py).
            token = spec_for(spec.service).registration.token(fields)
        except ValueError as bad:
            return error(*BAD_REQUEST, str(bad))
        return _register(ctx, name, session_id, spec.service, device, token)
    return _unregister(ctx, name, session_id, spec.service, device)


@dataclass(frozen=True, slots=True)
class _Device:
    bare_jid: str
    device_id: str
    room: str


async def _register(
    ctx: LinkContext, name: str, session_id: str, service: Service, device: _Device, token: str
) -> Answer:
    try:
        answer = await ctx.run_blocking(
            registrations.register_device,
            component=ctx.component,
            service=service,
            bare_jid=device.bare_jid,
            device_id=device.device_id,
            token=token,
            room_jid=device.room,
        )
    except registrations.RegistrationRefused as refused:
        return error(*SLOW_DOWN, refused.text)
    except channels.ChannelRefused as refused:
        return error("not-acceptable", "modify", str(refused))
    except Unavailable:
        return error(*TRY_LATER)
    reply = _command_reply(name, session_id, "completed")
    reply.append(
        result_form(
            [
                ("jid", "jid-single", answer.component_jid),
                ("node", "text-single", answer.node),
                ("secret", "text-single", answer.secret),
            ]
        )
    )
    return Answer(reply)


async def _unregister(
    ctx: LinkContext, name: str, session_id: str, service: Service, device: _Device
) -> Answer:
    try:
        await ctx.run_blocking(
            registrations.unregister_device,
            component=ctx.component,
            service=service,
            bare_jid=device.bare_jid,
            device_id=device.device_id,
            room_jid=device.room,
        )
    except registrations.UnknownRegistration:
        return error(*ITEM_NOT_FOUND, "no such registration")
    except Unavailable:
        return error(*TRY_LATER)
    return Answer(_command_reply(name, session_id, "completed"))


def _command_reply(node: str, session_id: str, status: str) -> ET.Element:
    return ET.Element(
        q(COMMANDS_NS, "command"), {"node": node, "sessionid": session_id, "status": status}
    )


# --- XEP-0357 publish


def publish(ctx: LinkContext, request: Request) -> Outcome:
    sender = request.sender
    if sender.resource:
        return error(*FORBIDDEN, "publish from a full JID")
    if not ctx.component.serves_p2:
        return error(*ITEM_NOT_FOUND, "this component does not serve push notifications")
    try:
        payload = parse_publish(request.payload, max_length=ctx.max_field_length)
    except BadRequest as bad:
        return error(*BAD_REQUEST, str(bad))
    if not payload.secret:
        return error(*FORBIDDEN, "secret required")
    return _accept(
        ctx,
        publishing.Publish(
            component_id=ctx.component.pk,
            publishing_domain=sender.domain,
            node=payload.node,
            secret=payload.secret,
            important=payload.important,
            message_count=payload.message_count,
            pending_subscription_count=payload.pending_subscription_count,
        ),
    )


async def _accept(ctx: LinkContext, request: publishing.Publish) -> Answer:
    try:
        if ctx.accept_publish is not None:
            verdict = await ctx.accept_publish(request)
        else:
            verdict = await ctx.run_blocking(publishing.accept_publish, request)
    except Unavailable:
        return error(*TRY_LATER)
    log.log(
        logging.DEBUG if verdict is publishing.Verdict.ACCEPTED else logging.INFO,
        "publish.answered",
        extra={"component_id": ctx.component.pk, "verdict": verdict.value},
    )
    if verdict is publishing.Verdict.ACCEPTED:
        return Answer()
    if verdict is publishing.Verdict.UNKNOWN_NODE:
        return error(*ITEM_NOT_FOUND)
    if verdict is publishing.Verdict.FORBIDDEN:
        return error(*FORBIDDEN)
    if verdict is publishing.Verdict.RATE_LIMITED:
        return error(*SLOW_DOWN)
    return error(*TRY_LATER)


HANDLERS: dict[tuple[str, str], Handler] = {
    ("get", q(DISCO_INFO_NS, "query")): disco_info,
    ("get", q(DISCO_ITEMS_NS, "query")): disco_items,
    ("set", q(COMMANDS_NS, "command")): command,
    ("set", q(PUBSUB_NS, "pubsub")): publish,
}


def dispatch(ctx: LinkContext, iq_type: str, sender: str, payload: ET.Element | None) -> Outcome:
    """Route a get/set iq by its payload; anything we do not offer is `service-unavailable`.

    The sender is checked first: an address that is not a JID gets `jid-malformed` (the
    user's server stamps it, so only a broken or hostile server sends one).
    """
    try:
        jid = JID(sender)
    except InvalidJID:
        return error(*JID_MALFORMED, "the sender is not a valid JID")
    if not jid.domain:
        return error(*JID_MALFORMED, "the iq has no sender")
    if payload is None:
        return error(*BAD_REQUEST, "an iq needs exactly one payload")
    handler = HANDLERS.get((iq_type, payload.tag))
    if handler is not None:
        return handler(ctx, Request(iq_type, jid, payload))
    served_elsewhere = ctx.iq_set_handlers.get(payload.tag) if iq_type == "set" else None
    if served_elsewhere is not None:
        return served_elsewhere(ctx, jid, payload)
    return error(*SERVICE_UNAVAILABLE)
