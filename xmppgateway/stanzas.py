"""Reading and writing the XML payloads of the p2 protocol, on plain ElementTree elements.

Parsing works on the raw element (not slixmpp stanza plugins) so that hostile or odd shapes
(missing forms, repeated fields, huge values) are judged by our rules, field by field.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass

DATA_NS = "jabber:x:data"
COMMANDS_NS = "http://jabber.org/protocol/commands"
PUBSUB_NS = "http://jabber.org/protocol/pubsub"
PUSH_NS = "urn:xmpp:push:0"
DISCO_INFO_NS = "http://jabber.org/protocol/disco#info"
DISCO_ITEMS_NS = "http://jabber.org/protocol/disco#items"
PUSH_SUMMARY = "urn:xmpp:push:summary"


class BadRequest(Exception):
    """The payload cannot be understood; answered with `bad-request` (modify)."""


def q(ns: str, tag: str) -> str:
    return f"{{{ns}}}{tag}"


def form_fields(form: ET.Element | None, *, max_length: int) -> dict[str, str]:
    """The first value of each field; a value longer than `max_length` is a bad request."""
    fields: dict[str, str] = {}
    if form is None:
        return fields
    for field in form.findall(q(DATA_NS, "field")):
        var = field.get("var")
        if not var or var in fields:
            continue
        value_element = field.find(q(DATA_NS, "value"))
        value = (value_element.text or "") if value_element is not None else ""
        if len(value) > max_length:
            raise BadRequest(f"field {var[:32]!r} is too long")
        fields[var] = value
    return fields


@dataclass(frozen=True, slots=True)
class PublishPayload:
    node: str
    secret: str
    important: bool
    message_count: int | None
    pending_subscription_count: int | None


def _count(value: str | None) -> int | None:
    if value is None or not value.strip().isdigit():
        return None
    return min(int(value.strip()), 1_000_000)


def parse_publish(pubsub: ET.Element, *, max_length: int) -> PublishPayload:
    """Every publish shape seen from Prosody, ejabberd and others; body and sender are dropped."""
    publish = pubsub.find(q(PUBSUB_NS, "publish"))
    if publish is None:
        raise BadRequest("no publish element")
    node = publish.get("node", "")
    if not node or len(node) > 64:
        raise BadRequest("missing or invalid node")
    summary: dict[str, str] = {}
    notification = publish.find(f"{q(PUBSUB_NS, 'item')}/{q(PUSH_NS, 'notification')}")
    if notification is not None:
        summary = form_fields(notification.find(q(DATA_NS, "x")), max_length=max_length)
    options = pubsub.find(q(PUBSUB_NS, "publish-options"))
    option_fields = form_fields(
        options.find(q(DATA_NS, "x")) if options is not None else None, max_length=max_length
    )
    body = summary.get("last-message-body", "")
    return PublishPayload(
        node=node,
        secret=option_fields.get("secret", ""),
        important=bool(body.strip()),
        message_count=_count(summary.get("message-count")),
        pending_subscription_count=_count(summary.get("pending-subscription-count")),
    )


def result_form(fields: list[tuple[str, str, str]]) -> ET.Element:
    """A `jabber:x:data` form of type `form` from (var, type, value) triples."""
    form = ET.Element(q(DATA_NS, "x"), {"type": "form"})
    for var, field_type, value in fields:
        field = ET.SubElement(form, q(DATA_NS, "field"), {"type": field_type, "var": var})
        ET.SubElement(field, q(DATA_NS, "value")).text = value
    return form
