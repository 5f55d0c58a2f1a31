"""Identifiers and validation: what a device and its accounts are named by, and what is
stored of them (hashes only; docs/protocols.md 3.2)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from slixmpp.jid import JID, InvalidJID

from relay import conf
from relay.models import App
from relay.services import channels
from relay.windows.services.errors import ErrorKind, UwpxError

DEVICE_ID_PATTERN = r"^[0-9a-fA-F]{32,128}$"
ACCOUNT_ID_PATTERN = r"^[0-9a-fA-F]{64}$"
APP_KEY_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_CHANNEL_URI_LENGTH = channels.MAX_CHANNEL_URI_LENGTH
# RFC 7622: local part, domain part and resource up to 1023 bytes each.
MAX_BARE_JID_LENGTH = 2047

_DEVICE_ID = re.compile(DEVICE_ID_PATTERN)
_ACCOUNT_ID = re.compile(ACCOUNT_ID_PATTERN)
_APP_KEY = re.compile(APP_KEY_PATTERN)

DEVICE_ID_RULE = "device_id must be 32 to 128 hexadecimal characters (UWPX sends 64)."
UNKNOWN_DEVICE = "Device id unknown."


@dataclass(frozen=True, slots=True)
class AccountRef:
    """One account as the client names it: exactly one of the two is set."""

    bare_jid: str = ""
    account_id: str = ""


@dataclass(frozen=True, slots=True)
class AccountAnswer:
    bare_jid: str  # "" when the client named the account by its id
    account_id: str  # sha256_hex(device_id + bare_jid): the account_id of every WNS push
    node: str
    secret: str


@dataclass(frozen=True, slots=True)
class AccountsAnswer:
    push_bare_jid: str
    accounts: list[AccountAnswer]


@dataclass(frozen=True, slots=True)
class Wanted:
    ref: AccountRef
    device_hash: str
    domain: str  # "" when named by account id
    index: int  # first position in the client's list, for error messages


# --- identifiers and validation ---------------------------------------------------------------


def device_id_hash(device_id: str) -> str:
    """What is stored of a device id (WnsDevice.device_id_hash)."""
    return hashlib.sha256(device_id.encode()).hexdigest()


def account_id(*, device_id: str, bare_jid: str) -> str:
    """sha256_hex(device_id + bare_jid), as UWPX computes it (docs/protocols.md 3.2).

    The JID is hashed exactly as the client sent it: the client recomputes this value from its
    own spelling to know which account a push is for.
    """
    return hashlib.sha256(f"{device_id}{bare_jid}".encode()).hexdigest()


def validate_device_id(device_id: object) -> str:
    if not isinstance(device_id, str) or not _DEVICE_ID.fullmatch(device_id):
        raise UwpxError(ErrorKind.INVALID, DEVICE_ID_RULE)
    return device_id


def bare_jid_domain(bare_jid: object, *, field: str = "bare_jid") -> str:
    """Parse an account's bare JID (RFC 7622, via slixmpp) and return its normalized domain."""
    if not isinstance(bare_jid, str) or not bare_jid:
        raise UwpxError(ErrorKind.INVALID, f"{field} must be a non-empty string.")
    if len(bare_jid.encode()) > MAX_BARE_JID_LENGTH:
        raise UwpxError(ErrorKind.INVALID, f"{field} is longer than a JID can be.")
    try:
        jid = JID(bare_jid)
    except InvalidJID as error:
        raise UwpxError(ErrorKind.INVALID, f"{field} is not a valid JID: {error}.") from None
    except ValueError:  # e.g. a UnicodeError deep in IDNA: still the client's input
        raise UwpxError(ErrorKind.INVALID, f"{field} is not a valid JID.") from None
    if jid.resource:
        raise UwpxError(ErrorKind.INVALID, f"{field} must be a bare JID, without a /resource.")
    if not jid.user:
        raise UwpxError(ErrorKind.INVALID, f"{field} must be an account's JID (name@domain).")
    return str(jid.domain)


def validate_channel_uri(*, app: App, channel_uri: object) -> str:
    """Refuse a channel the worker could never send to (relay.services.channels)."""
    if not isinstance(channel_uri, str) or not channels.wns_channel_sendable(
        app=app, channel_uri=channel_uri
    ):
        reason = channels.why_not_sendable(app=app, channel_uri=channel_uri)
        raise UwpxError(ErrorKind.INVALID, f"channel_uri: {reason}")
    return channel_uri


def resolve_accounts(*, device_id: str, accounts: Sequence[AccountRef]) -> list[Wanted]:
    """Validate the list; the same account named twice counts once (first position wins)."""
    limit = conf.current().uwpx_max_accounts
    if len(accounts) > limit:
        raise UwpxError(ErrorKind.INVALID, f"accounts: at most {limit} accounts per device.")
    wanted: dict[str, Wanted] = {}
    for index, ref in enumerate(accounts):
        field = f"accounts[{index}]"
        if bool(ref.bare_jid) == bool(ref.account_id):
            raise UwpxError(ErrorKind.INVALID, f"{field} needs either bare_jid or account_id.")
        if ref.bare_jid:
            domain = bare_jid_domain(ref.bare_jid, field=f"{field}.bare_jid")
            digest = account_id(device_id=device_id, bare_jid=ref.bare_jid)
        else:
            if not _ACCOUNT_ID.fullmatch(ref.account_id):
                raise UwpxError(
                    ErrorKind.INVALID, f"{field}.account_id must be 64 hexadecimal characters."
                )
            domain, digest = "", ref.account_id
        wanted.setdefault(digest, Wanted(ref, digest, domain, index))
    return list(wanted.values())
