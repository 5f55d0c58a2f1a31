"""What the single and the batched path both build: a device's registration as read, a new
registration, and the answer to set_accounts."""

from __future__ import annotations

from dataclasses import dataclass

from relay.identifiers import new_node, new_secret
from relay.models import App, Registration, Service
from relay.windows.services.identifiers import AccountAnswer, AccountsAnswer, Wanted


@dataclass(slots=True)
class Mine:
    """One of the device's registrations as read under the device's lock."""

    id: int
    device_hash: str
    node: str
    secret: str
    account_domain: str
    token: str
    dead: bool
    component_id: int


def new_registration(app: App, component_id: int, wanted: Wanted, channel_uri: str) -> Registration:
    """A Windows device's registration for one account (the single and the batched path);
    its link to the device (WnsAccount) is written with it."""
    return Registration(
        app=app,
        component_id=component_id,
        service=Service.WNS,
        device_hash=wanted.device_hash,
        room_hash="",
        account_domain=wanted.domain,
        token=channel_uri,
        node=new_node(),
        secret=new_secret(),
    )


def accounts_answer(
    wanted: list[Wanted],
    existing: dict[str, Mine],
    created: dict[str, Registration],
    component_jid: str | None,
) -> AccountsAnswer:
    answers = []
    for item in wanted:
        reg = existing.get(item.device_hash) or created[item.device_hash]
        answers.append(
            AccountAnswer(
                bare_jid=item.ref.bare_jid,
                account_id=item.device_hash,
                node=reg.node,
                secret=reg.secret,
            )
        )
    return AccountsAnswer(push_bare_jid=component_jid or "", accounts=answers)
