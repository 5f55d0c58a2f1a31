"""The UnifiedPush HTTP surface, thin: the push resource (RFC 8030 / UnifiedPush server spec),
message resources for DELETE, and the Matrix push gateway. The rules live in
`relay.unifiedpush.services`."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from relay.unifiedpush import http as unifiedpush_http
from relay.unifiedpush.services import matrix, messages
from relay.unifiedpush.services.messages import PushRefused

DISCOVERY = {"unifiedpush": {"version": 1}}
MATRIX_DISCOVERY = {"unifiedpush": {"gateway": "matrix"}}


def _refused(refusal: PushRefused) -> HttpResponse:
    response = JsonResponse({"error": refusal.reason}, status=refusal.status)
    if refusal.retry_after is not None:
        response["Retry-After"] = str(refusal.retry_after)
    return response


def _not_allowed(*allowed: str) -> HttpResponse:
    response = JsonResponse({"error": "method not allowed"}, status=405)
    response["Allow"] = ", ".join(allowed)
    return response


def _content_length(request: HttpRequest) -> int | None:
    """The declared length; None when absent. A malformed one is refused by Django already."""
    value = request.META.get("CONTENT_LENGTH") or ""
    return int(value) if value.isdigit() else None


@csrf_exempt
def push_resource(request: HttpRequest, token: str) -> HttpResponse:
    """GET discovers; POST stores (usually answered by `FastPushPath` before Django)."""
    if request.method == "POST":
        status, headers, body = unifiedpush_http.sendable(
            unifiedpush_http.post(
                token=token,
                content_length=request.META.get("CONTENT_LENGTH") or "",
                transfer_encoding=request.META.get("HTTP_TRANSFER_ENCODING", ""),
                read=request.read,
                header=request.headers.get,
            )
        )
        response = HttpResponse(body, status=status)
        for name, value in headers:
            response[name] = value
        return response
    if request.method in ("GET", "HEAD"):
        try:
            messages.discover(token=token)
        except PushRefused as refusal:
            return _refused(refusal)
        return JsonResponse(DISCOVERY)
    return _not_allowed("GET", "POST")


@csrf_exempt
def message_resource(request: HttpRequest, reference: str) -> HttpResponse:
    if request.method != "DELETE":
        return _not_allowed("DELETE")
    try:
        messages.withdraw(reference=reference)
    except PushRefused as refusal:
        return _refused(refusal)
    return HttpResponse(status=204)


@csrf_exempt
def matrix_notify(request: HttpRequest) -> HttpResponse:
    if request.method == "GET":
        return JsonResponse(MATRIX_DISCOVERY)
    if request.method != "POST":
        return _not_allowed("GET", "POST")
    length = _content_length(request)
    if length is not None and length > matrix.MAX_REQUEST_BYTES:
        return JsonResponse({"errcode": "M_TOO_LARGE", "error": "request too large"}, status=413)
    try:
        document = json.loads(request.read(matrix.MAX_REQUEST_BYTES + 1))
    except (ValueError, UnicodeDecodeError):
        return JsonResponse({"errcode": "M_NOT_JSON", "error": "not JSON"}, status=400)
    try:
        rejected = matrix.notify(document)
    except matrix.BadNotification as bad:
        return JsonResponse({"errcode": "M_BAD_JSON", "error": str(bad)}, status=400)
    except PushRefused as refusal:
        response = JsonResponse(
            {"errcode": "M_LIMIT_EXCEEDED", "error": refusal.reason}, status=refusal.status
        )
        if refusal.retry_after is not None:
            response["Retry-After"] = str(refusal.retry_after)
        return response
    return JsonResponse({"rejected": rejected})
