"""Registering and unregistering devices (the p2 ad-hoc commands, and later the HTTP API)."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.utils import timezone

from relay.identifiers import account_hash, new_node, new_secret
from relay.models import Component, Registration, Service
from relay.services import lifecycle


class UnknownRegistration(Exception):
    """Nothing to unregister."""


@dataclass(frozen=True, slots=True)
class RegistrationAnswer:
    """What the phone needs to enable push on its server."""

    component_jid: str
    node: str
    secret: str


def _domain_of(bare_jid: str) -> str:
    return bare_jid.rsplit("@", 1)[-1]


def register_device(
    *,
    component: Component,
    service: Service,
    bare_jid: str,
    device_id: str,
    token: str,
    room_jid: str = "",
) -> RegistrationAnswer:
    """Create a registration, or update the token of the existing one.

    The same device (and room) keeps its node and secret: the phone may re-register whenever
    its token changes, and the user's server must keep publishing to the same node.
    """
    device_hash = account_hash(bare_jid, device_id)
    room_hash = account_hash(room_jid, device_id) if room_jid else ""
    key = {
        "app_id": component.app_id,
        "service": service,
        "device_hash": device_hash,
        "room_hash": room_hash,
    }
    for _ in range(3):
        registration = Registration.objects.filter(**key).first()
        if registration is not None:
            Registration.objects.filter(pk=registration.pk).update(
                token=token,
                component=component,
                account_domain=_domain_of(bare_jid),
                dead_since=None,
                updated=timezone.now(),
            )
            lifecycle.renewed(registration, token=token)
            return RegistrationAnswer(component.jid, registration.node, registration.secret)
        try:
            with transaction.atomic():
                registration = Registration.objects.create(
                    **key,
                    component=component,
                    account_domain=_domain_of(bare_jid),
                    token=token,
                    node=new_node(),
                    secret=new_secret(),
                )
                lifecycle.created([registration])
            return RegistrationAnswer(component.jid, registration.node, registration.secret)
        except IntegrityError:
            # A concurrent registration of the same device won, or (astronomically rarely)
            # the node collided: look again.
            continue
    raise RuntimeError("registration kept conflicting")


def unregister_device(
    *, component: Component, service: Service, bare_jid: str, device_id: str, room_jid: str = ""
) -> None:
    device_hash = account_hash(bare_jid, device_id)
    room_hash = account_hash(room_jid, device_id) if room_jid else ""
    deleted, _ = lifecycle.delete_logged(
        Registration.objects.filter(
            app_id=component.app_id, service=service, device_hash=device_hash, room_hash=room_hash
        )
    )
    if not deleted:
        raise UnknownRegistration
