"""One UWPX message in, one UWPX answer out: shared by the HTTP views and the TLS listener.

Thin on purpose: rate limits, validation and storage live in `relay.windows.services`.
"""

from __future__ import annotations

import json
import logging

from django.db import DatabaseError

from relay import conf
from relay.models import App
from relay.windows import services as uwpx
from relay.windows.api.schemas import (
    ErrorResponse,
    OkResponse,
    RequestTestPush,
    SetAccounts,
    SetChannelUri,
    parse_message,
)
from relay.windows.services import ErrorKind, UwpxError

log = logging.getLogger(__name__)

MALFORMED_JSON = "Invalid JSON format."
INTERNAL_ERROR = "Internal server error; try again later."
UNAVAILABLE = "Temporarily unavailable; try again later."

Message = SetChannelUri | SetAccounts | RequestTestPush


OK_BODY: dict[str, object] = OkResponse().model_dump()


def dispatch(*, app: App, message: Message) -> dict[str, object]:
    """Run one validated message for `app` (the per-device rate limit comes first); the
    answer's JSON body.

    Plain dicts, the shape of OkResponse and AccountsResponse (dumped without None): building
    those models, and the API validating them once more, would cost more CPU than storing."""
    uwpx.check_device_rate(device_id=message.device_id, action=message.action)
    if isinstance(message, SetChannelUri):
        uwpx.set_channel_uri(app=app, device_id=message.device_id, channel_uri=message.channel_uri)
        return dict(OK_BODY)
    if isinstance(message, SetAccounts):
        answer = uwpx.set_accounts(
            app=app,
            device_id=message.device_id,
            accounts=[
                uwpx.AccountRef(bare_jid=item.bare_jid or "", account_id=item.account_id or "")
                for item in message.accounts
            ],
        )
        accounts: list[dict[str, object]] = []
        for account in answer.accounts:
            out: dict[str, object] = {}
            if account.bare_jid:
                out["bare_jid"] = account.bare_jid
            out.update(
                account_id=account.account_id,
                node=account.node,
                secret=account.secret,
                success=True,
            )
            accounts.append(out)
        return {**OK_BODY, "push_bare_jid": answer.push_bare_jid, "accounts": accounts}
    uwpx.request_test_push(app=app, device_id=message.device_id)
    return dict(OK_BODY)


def error_body(message: str) -> dict[str, object]:
    return ErrorResponse(error=message).model_dump()


def handle_frame(*, app_key: str, frame: bytes, client_address: str) -> dict[str, object]:
    """The listener's whole request path for one NUL-framed message; never raises."""
    try:
        uwpx.check_address_rate(client_address=client_address)
        if len(frame) > conf.current().uwpx_max_body_bytes:
            raise UwpxError(ErrorKind.TOO_LARGE, too_large_message())
        try:
            data = json.loads(frame.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise UwpxError(ErrorKind.MALFORMED, MALFORMED_JSON) from None
        message = parse_message(data)
        app = uwpx.app_for_key(public_key=app_key)
        return dispatch(app=app, message=message)
    except UwpxError as error:
        return error_body(error.message)
    except DatabaseError as error:
        log.warning("uwpx.database_unavailable", extra={"error_type": type(error).__name__})
        return error_body(UNAVAILABLE)
    except Exception:
        log.exception("uwpx.internal_error")
        return error_body(INTERNAL_ERROR)


def too_large_message() -> str:
    return f"Message too large: at most {conf.current().uwpx_max_body_bytes} bytes."
