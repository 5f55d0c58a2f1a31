"""The UWPX wire messages (docs/protocols.md 3.1) as strict schemas, shared by the API and listener.

Strict: unknown fields, wrong types (`"1"` for 1, `true` for 1) and missing fields are refused
with a message that names the field. Rules that need the database or settings (allowed channel
hosts, the accounts limit, JID parsing) are checked again in `relay.windows.services`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic_core import PydanticCustomError

from relay.windows import services as uwpx

DEVICE_ID_DESCRIPTION = (
    "The device's identifier, 32 to 128 hexadecimal characters (UWPX sends a SHA-256, 64). "
    "It is the only thing that proves a request comes from the device: keep it secret."
)


class _Strict(BaseModel):
    # Plain pydantic models, not ninja's Schema: its wrapping validator (for reading ORM
    # objects, which these never are) would be the larger part of validating a message.
    model_config = ConfigDict(extra="forbid", strict=True)


class _Message(_Strict):
    version: Literal[1] = Field(description="Protocol version: always 1.")
    device_id: str = Field(
        min_length=32,
        max_length=128,
        pattern=uwpx.DEVICE_ID_PATTERN,
        description=DEVICE_ID_DESCRIPTION,
    )

    @field_validator("version", mode="before")
    @classmethod
    def _integer_version(cls, value: Any) -> Any:
        # Literal[1] alone would take true and 1.0.
        if type(value) is not int:
            raise PydanticCustomError("version_type", "must be the integer 1")
        return value


class SetChannelUri(_Message):
    """Store the device's WNS channel URI; sent when the client starts with a new channel."""

    action: Literal["set_channel_uri"]
    channel_uri: str = Field(
        min_length=1,
        max_length=uwpx.MAX_CHANNEL_URI_LENGTH,
        description="The WNS channel URI (https://*.notify.windows.com/?token=…).",
    )


class AccountIn(_Strict):
    """An account, by bare JID (as documented) or by account id (as the shipped client sends)."""

    bare_jid: str | None = Field(
        default=None,
        min_length=1,
        max_length=uwpx.MAX_BARE_JID_LENGTH,
        description="The account's bare JID, e.g. someClient@xmpp.uwpx.org.",
    )
    account_id: str | None = Field(
        default=None,
        pattern=uwpx.ACCOUNT_ID_PATTERN,
        description="Instead of bare_jid: sha256_hex(device_id + bare_jid).",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> AccountIn:
        if (self.bare_jid is None) == (self.account_id is None):
            raise PydanticCustomError("account_name", "needs either bare_jid or account_id")
        return self


class SetAccounts(_Message):
    """Replace the device's push accounts; an empty list turns push off for the device."""

    action: Literal["set_accounts", "set_push_accounts"] = Field(
        description="set_push_accounts is what the shipped UWPX client sends; both mean the same."
    )
    accounts: list[AccountIn] = Field(
        description="All accounts that should receive pushes; the others are removed."
    )


class RequestTestPush(_Message):
    """Send one wake-up to the device, for its first account, through the normal send path."""

    action: Literal["request_test_push"]


UwpxMessage = Annotated[
    SetChannelUri | SetAccounts | RequestTestPush, Field(discriminator="action")
]
MESSAGE = TypeAdapter(UwpxMessage)
ACTIONS = ("set_channel_uri", "set_accounts", "set_push_accounts", "request_test_push")


class OkResponse(_Strict):
    version: Literal[1] = 1
    action: Literal["response"] = "response"
    status: Literal[1] = 1


class AccountOut(_Strict):
    bare_jid: str | None = Field(
        default=None, description="As sent; absent when the account was named by account_id."
    )
    account_id: str = Field(description="sha256_hex(device_id + bare_jid); WNS pushes carry it.")
    node: str = Field(description="The node to enable push with (XEP-0357).")
    secret: str = Field(description="The secret to enable push with (publish-options).")
    success: bool = True


class AccountsResponse(OkResponse):
    push_bare_jid: str = Field(description="The JID to enable push with (the push component).")
    accounts: list[AccountOut]


class ErrorResponse(_Strict):
    version: Literal[1] = 1
    action: Literal["response"] = "response"
    status: Literal[0] = 0
    error: str = Field(description="What was wrong, in clear text.")


# --- clear text for schema errors ---------------------------------------------------------------

_MESSAGES = {
    "missing": "is required",
    "extra_forbidden": "is not a known field",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "bool_type": "must be true or false",
    "model_type": "must be a JSON object",
    "model_attributes_type": "must be a JSON object",
    "dict_type": "must be a JSON object",
}


def _field(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def describe(errors: Sequence[Mapping[str, Any]], *, skip: int = 0) -> str:
    """One line naming each problem, e.g. "device_id: must be ...; accounts[0].x: ..."."""
    lines = []
    for error in errors[:5]:
        loc = tuple(error.get("loc", ()))[skip:]
        kind = error.get("type", "")
        if loc and loc[0] in ACTIONS:  # the union's tag, not a field
            loc = loc[1:]
        field = _field(loc)
        if kind == "union_tag_invalid":
            lines.append(f"action: unknown action; expected one of {', '.join(ACTIONS)}")
            continue
        if kind == "union_tag_not_found":
            lines.append(f"action is required: one of {', '.join(ACTIONS)}")
            continue
        if field == "device_id" and kind.startswith("string_"):
            lines.append(uwpx.DEVICE_ID_RULE.rstrip("."))
            continue
        if field.endswith("account_id") and kind == "string_pattern_mismatch":
            lines.append(f"{field}: must be 64 hexadecimal characters")
            continue
        if field == "version" and kind == "literal_error":
            lines.append("version: must be the integer 1")
            continue
        if field == "action" and kind == "literal_error":
            expected = error.get("ctx", {}).get("expected", "")
            lines.append(f"action: must be {expected} at this URL")
            continue
        message = _MESSAGES.get(kind) or error.get("msg", "is not valid")
        lines.append(f"{field}: {message}" if field else f"request body: {message}")
    more = len(errors) - 5
    if more > 0:
        lines.append(f"and {more} more")
    return "Invalid message: " + "; ".join(lines) + "."


def parse_message(data: object) -> SetChannelUri | SetAccounts | RequestTestPush:
    """Validate one decoded JSON message (listener path); UwpxError when it is not valid."""
    try:
        return MESSAGE.validate_python(data)
    except PydanticValidationError as error:
        raise uwpx.UwpxError(uwpx.ErrorKind.INVALID, describe(error.errors())) from None
