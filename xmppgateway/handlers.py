"""Stanza handlers: parse the iq, call a service, turn its verdict into an answer.

Every get/set iq gets exactly one answer; a handler never raises to slixmpp (which would
answer `feature-not-implemented`, a hard error that makes servers drop registrations).
"""

from __future__ import annotations

import logging
import secrets
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from slixmpp.jid import JID, InvalidJID

from relay.models import Component, Service
from relay.services import publishing, registrations
from relay.services.unifiedpush import UP_NS
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
# A handler for an iq-set payload another module serves (xmppgateway.unifiedpush).
IqHandler = Callable[["LinkContext", JID, ET.Element], Awaitable["Answer"]]


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
SLOW_DOWN = "resource-constraint", "wait"  # the tenant's rate limit


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
    # iq-set payloads by qualified tag, served elsewhere (the UnifiedPush register iq).
    iq_set_handlers: Mapping[str, IqHandler] = field(default_factory=dict)


# --- disco


def disco_info(ctx: LinkContext, query: ET.Element) -> Answer:
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
        if ctx.component.serves_unifiedpush:
            features.append(UP_NS)
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


def disco_items(ctx: LinkContext, query: ET.Element) -> Answer:
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


async def command(ctx: LinkContext, sender: JID, element: ET.Element) -> Answer:
    name = element.get("node", "")
    spec = COMMANDS.get(name)
    if spec is None:
        return error(*ITEM_NOT_FOUND, "unknown command")
    if not ctx.component.serves_p2:
        return error(*SERVICE_UNAVAILABLE, "this component serves UnifiedPush only")
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
    token = fields.get("token", "").strip()
    if not device_id:
        return error(*BAD_REQUEST, "device-id is required")
    bare_jid = str(sender.bare)
    try:
        if spec.action == "register":
            if not token:
                return error(*BAD_REQUEST, "token is required")
            answer = await ctx.run_blocking(
                registrations.register_device,
                component=ctx.component,
                service=spec.service,
                bare_jid=bare_jid,
                device_id=device_id,
                token=token,
                room_jid=room,
            )
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
        await ctx.run_blocking(
            registrations.unregister_device,
            component=ctx.component,
            service=spec.service,
            bare_jid=bare_jid,
            device_id=device_id,
            room_jid=room,
        )
        return Answer(_command_reply(name, session_id, "completed"))
    except registrations.UnknownRegistration:
        return error(*ITEM_NOT_FOUND, "no such registration")
    except Unavailable:
        return error(*TRY_LATER)


def _command_reply(node: str, session_id: str, status: str) -> ET.Element:
    return ET.Element(
        q(COMMANDS_NS, "command"), {"node": node, "sessionid": session_id, "status": status}
    )


# --- XEP-0357 publish


async def publish(ctx: LinkContext, sender: JID, pubsub: ET.Element) -> Answer:
    if sender.resource:
        return error(*FORBIDDEN, "publish from a full JID")
    if not ctx.component.serves_p2:
        return error(*ITEM_NOT_FOUND, "this component serves UnifiedPush only")
    try:
        payload = parse_publish(pubsub, max_length=ctx.max_field_length)
    except BadRequest as bad:
        return error(*BAD_REQUEST, str(bad))
    if not payload.secret:
        return error(*FORBIDDEN, "secret required")
    request = publishing.Publish(
        component_id=ctx.component.pk,
        publishing_domain=sender.domain,
        node=payload.node,
        secret=payload.secret,
        important=payload.important,
        message_count=payload.message_count,
        pending_subscription_count=payload.pending_subscription_count,
    )
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


async def dispatch(
    ctx: LinkContext, iq_type: str, sender: JID, payload: ET.Element | None
) -> Answer:
    """Route a get/set iq by its payload; anything we do not offer is `service-unavailable`."""
    if payload is None:
        return error(*BAD_REQUEST, "empty iq")
    tag = payload.tag
    if iq_type == "get":
        if tag == q(DISCO_INFO_NS, "query"):
            return disco_info(ctx, payload)
        if tag == q(DISCO_ITEMS_NS, "query"):
            return disco_items(ctx, payload)
    elif iq_type == "set":
        if tag == q(COMMANDS_NS, "command"):
            return await command(ctx, sender, payload)
        if tag == q(PUBSUB_NS, "pubsub"):
            return await publish(ctx, sender, payload)
        served_elsewhere = ctx.iq_set_handlers.get(tag)
        if served_elsewhere is not None:
            return await served_elsewhere(ctx, sender, payload)
    return error(*SERVICE_UNAVAILABLE)
