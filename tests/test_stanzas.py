"""Parsing every publish shape real servers send, without keeping body or sender."""

import xml.etree.ElementTree as ET

import pytest

from xmppgateway.stanzas import BadRequest, parse_publish

pytestmark = pytest.mark.defaults

PROSODY_PUBLISH = (
    "<iq id='0b85' to='push.localhost' from='localhost' type='set'>"
    "<pubsub xmlns='http://jabber.org/protocol/pubsub'><publish node='NODE1'><item>"
    "<notification xmlns='urn:xmpp:push:0'><x type='form' xmlns='jabber:x:data'>"
    "<field var='FORM_TYPE' type='hidden'><value>urn:xmpp:push:summary</value></field>"
    "<field var='message-count' type='text-single'><value>1</value></field>"
    "<field var='pending-subscription-count' type='text-single'/>"
    "<field var='last-message-sender' type='jid-single'/>"
    "<field var='last-message-body' type='text-single'><value>New Message!</value></field>"
    "</x></notification></item></publish><publish-options>"
    "<x type='submit' xmlns='jabber:x:data'><field var='FORM_TYPE'>"
    "<value>http://jabber.org/protocol/pubsub#publish-options</value></field>"
    "<field var='secret'><value>eruio234vzxc2kla-91</value></field></x>"
    "</publish-options></pubsub></iq>"
)

EJABBERD_EMPTY_PUBLISH = (
    "<iq type='set' from='localhost' to='push.localhost' id='1'>"
    "<pubsub xmlns='http://jabber.org/protocol/pubsub'><publish node='NODE2'><item>"
    "<notification xmlns='urn:xmpp:push:0'/></item></publish><publish-options>"
    "<x type='submit' xmlns='jabber:x:data'><field var='FORM_TYPE'>"
    "<value>http://jabber.org/protocol/pubsub#publish-options</value></field>"
    "<field var='secret'><value>s</value></field></x></publish-options></pubsub></iq>"
)


def pubsub_of(iq_text):
    return ET.fromstring(iq_text)[0]


def test_prosody_publish_with_body_is_important():
    payload = parse_publish(pubsub_of(PROSODY_PUBLISH), max_length=4096)
    assert payload.node == "NODE1"
    assert payload.secret == "eruio234vzxc2kla-91"
    assert payload.important is True
    assert payload.message_count == 1
    assert payload.pending_subscription_count is None


def test_ejabberd_publish_without_form_is_a_silent_wakeup():
    payload = parse_publish(pubsub_of(EJABBERD_EMPTY_PUBLISH), max_length=4096)
    assert payload.node == "NODE2"
    assert payload.secret == "s"
    assert payload.important is False
    assert payload.message_count is None


def test_publish_without_node_is_a_bad_request():
    text = PROSODY_PUBLISH.replace(" node='NODE1'", "")
    with pytest.raises(BadRequest):
        parse_publish(pubsub_of(text), max_length=4096)


def test_huge_field_value_is_a_bad_request():
    text = PROSODY_PUBLISH.replace("New Message!", "x" * 5000)
    with pytest.raises(BadRequest, match="too long"):
        parse_publish(pubsub_of(text), max_length=4096)


def test_garbage_counts_are_ignored():
    text = PROSODY_PUBLISH.replace("<value>1</value>", "<value>-7; DROP</value>")
    assert parse_publish(pubsub_of(text), max_length=4096).message_count is None


def test_publish_without_options_has_no_secret():
    text = PROSODY_PUBLISH.split("<publish-options>")[0] + "</pubsub></iq>"
    assert parse_publish(pubsub_of(text), max_length=4096).secret == ""
