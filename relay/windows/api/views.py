"""The versioned HTTP API (`/api/v1/`): UWPX-style registration for Windows clients.

Thin: each view names its app by the URL's public key and hands the parsed message to
`relay.windows.api.protocol`. Every answer, errors included, has the UWPX response shape. Before the
body is parsed, `_guard` checks the per-address rate limit and the body size.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from ninja import Body, NinjaAPI, Router
from ninja.decorators import decorate_view
from ninja.errors import HttpError, ValidationError

from relay import conf
from relay.windows import services as uwpx
from relay.windows.api import protocol
from relay.windows.api.schemas import (
    AccountsResponse,
    ErrorResponse,
    OkResponse,
    RequestTestPush,
    SetAccounts,
    SetChannelUri,
    UwpxMessage,
    describe,
)
from relay.windows.services import ErrorKind, UwpxError

log = logging.getLogger(__name__)

# Set by relay.windows.api.fast on a request it hands on after counting its address.
GUARDED = "relay.uwpx.address_counted"

STATUS = {
    ErrorKind.MALFORMED: 400,
    ErrorKind.INVALID: 422,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.UNKNOWN_APP: 404,
    ErrorKind.UNKNOWN_DEVICE: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.RATE_LIMITED: 429,
    ErrorKind.UNAVAILABLE: 503,
}
ERRORS: dict[int, Any] = {code: ErrorResponse for code in sorted(set(STATUS.values()))}

DESCRIPTION = """
Registration of Windows (UWPX-style) clients, relayed through WNS. See docs/windows-api.md.

Every URL names the app by its public key (shown in the admin). Requests and answers are the
JSON messages of the UWPX push protocol: `{"version": 1, "action": ...}` in, and
`{"version": 1, "action": "response", "status": 1, ...}` or
`{"version": 1, "action": "response", "status": 0, "error": "..."}` out.
"""

api = NinjaAPI(
    title="XMPP push relay",
    version="1",
    description=DESCRIPTION,
    urls_namespace="api-v1",
    docs_url="/docs",
)
router = Router(tags=["Windows clients (UWPX)"])


def client_address(request: HttpRequest) -> str:
    """The peer address, or the one the configured number of trusted proxies reported."""
    proxies = conf.current().api_trusted_proxies
    if proxies > 0:
        forwarded = [
            part.strip()
            for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
            if part.strip()
        ]
        if len(forwarded) >= proxies:
            return forwarded[-proxies]
    return str(request.META.get("REMOTE_ADDR", ""))


def error_response(request: HttpRequest, error: UwpxError) -> HttpResponse:
    response = api.create_response(
        request, protocol.error_body(error.message), status=STATUS[error.kind]
    )
    if error.retry_after is not None:
        response["Retry-After"] = str(math.ceil(error.retry_after))
    return response


def _check_size(request: HttpRequest) -> None:
    limit = conf.current().uwpx_max_body_bytes
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > limit:
        raise UwpxError(ErrorKind.TOO_LARGE, protocol.too_large_message())
    try:
        body = request.body
    except RequestDataTooBig:
        raise UwpxError(ErrorKind.TOO_LARGE, protocol.too_large_message()) from None
    if len(body) > limit:
        raise UwpxError(ErrorKind.TOO_LARGE, protocol.too_large_message())


def _guard(run: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Before the body is parsed: the per-address rate limit, then the size limit."""

    @functools.wraps(run)
    def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            if not request.META.get(GUARDED):  # not counted already (relay.windows.api.fast)
                uwpx.check_address_rate(client_address=client_address(request))
            _check_size(request)
        except UwpxError as error:
            return error_response(request, error)
        return run(request, *args, **kwargs)

    return guarded


def answer(request: HttpRequest, app_key: str, message: protocol.Message) -> HttpResponse:
    """The answer, rendered here: the body is already what the response schemas describe
    (protocol.dispatch), and ninja validating it again cost as much as storing it."""
    body = protocol.dispatch(app=uwpx.app_for_key(public_key=app_key), message=message)
    return api.create_response(request, body, status=200)


@router.post(
    "/apps/{app_key}/uwpx",
    operation_id="uwpx_message",
    response={200: AccountsResponse | OkResponse, **ERRORS},
    exclude_none=True,
    summary="Any UWPX message (the original single-endpoint style)",
    description="The message's `action` says what to do, as on the UWPX TLS socket.",
)
@decorate_view(_guard)
def uwpx_message(request: HttpRequest, app_key: str, message: Body[UwpxMessage]) -> HttpResponse:
    return answer(request, app_key, message)


@router.post(
    "/apps/{app_key}/uwpx/set_channel_uri",
    operation_id="uwpx_set_channel_uri",
    response={200: OkResponse, **ERRORS},
    summary="Set the device's WNS channel URI",
)
@decorate_view(_guard)
def set_channel_uri(request: HttpRequest, app_key: str, message: SetChannelUri) -> HttpResponse:
    return answer(request, app_key, message)


@router.post(
    "/apps/{app_key}/uwpx/set_accounts",
    operation_id="uwpx_set_accounts",
    response={200: AccountsResponse, **ERRORS},
    exclude_none=True,
    summary="Replace the device's push accounts (also accepts action set_push_accounts)",
)
@decorate_view(_guard)
def set_accounts(request: HttpRequest, app_key: str, message: SetAccounts) -> HttpResponse:
    return answer(request, app_key, message)


@router.post(
    "/apps/{app_key}/uwpx/request_test_push",
    operation_id="uwpx_request_test_push",
    response={200: OkResponse, **ERRORS},
    summary="Send a test push to the device",
)
@decorate_view(_guard)
def request_test_push(request: HttpRequest, app_key: str, message: RequestTestPush) -> HttpResponse:
    return answer(request, app_key, message)


api.add_router("", router)


# --- every error in the UWPX shape ------------------------------------------------------------


@api.exception_handler(UwpxError)
def _uwpx_error(request: HttpRequest, error: UwpxError) -> HttpResponse:
    return error_response(request, error)


@api.exception_handler(ValidationError)
def _validation_error(request: HttpRequest, error: ValidationError) -> HttpResponse:
    message = describe(_body_errors(error.errors))
    return error_response(request, UwpxError(ErrorKind.INVALID, message))


def _body_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop ninja's ("body", <parameter>) prefix; a missing body is a message of its own."""
    cleaned = []
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if loc[:1] == ("body",):
            loc = loc[2:]
            if not loc and error.get("type") == "missing":
                error = {**error, "type": "model_type"}
        cleaned.append({**error, "loc": loc})
    return cleaned


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, error: HttpError) -> HttpResponse:
    if error.status_code == 400:  # ninja: the body is not JSON
        return error_response(request, UwpxError(ErrorKind.MALFORMED, protocol.MALFORMED_JSON))
    return api.create_response(request, protocol.error_body(str(error)), status=error.status_code)


@api.exception_handler(DatabaseError)
def _database_error(request: HttpRequest, error: DatabaseError) -> HttpResponse:
    log.warning("api.database_unavailable", extra={"error_type": type(error).__name__})
    return error_response(request, UwpxError(ErrorKind.UNAVAILABLE, protocol.UNAVAILABLE))


@api.exception_handler(Exception)
def _internal_error(request: HttpRequest, error: Exception) -> HttpResponse:
    log.exception("api.internal_error", extra={"error_type": type(error).__name__})
    return api.create_response(request, protocol.error_body(protocol.INTERNAL_ERROR), status=500)
