"""The second step's pages, enrolment, and each staff member's security page.

Thin: every decision is in `services.second_factor`, `services.passkeys` and
`services.sessions`. The pages under `second-factor/` answer before the second step (the
middleware lets them through); the security page does not.
"""

from __future__ import annotations

import json
from typing import Any

import segno
from django.contrib import admin, messages
from django.contrib.auth import logout
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    JsonResponse,
)
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from relay.admin_site import locked_out
from relay.operators.services import passkeys, second_factor, sessions

PENDING_TOTP = "operators_pending_totp"


def _next(request: HttpRequest) -> str:
    wanted = request.POST.get("next") or request.GET.get("next") or ""
    if wanted and url_has_allowed_host_and_scheme(
        wanted, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return wanted
    return reverse("admin:index")


def _staff(request: HttpRequest) -> bool:
    user = request.user
    return bool(user.is_authenticated and user.is_active and user.is_staff)


def _to_login(request: HttpRequest) -> HttpResponse:
    return HttpResponseRedirect(reverse("admin:login") + "?next=" + reverse("admin:index"))


def _page(request: HttpRequest, template: str, title: str, **context: Any) -> TemplateResponse:
    site = admin.site.each_context(request)
    if second_factor.is_required(request.user) and not second_factor.is_verified(request.user):
        # Before the second step the admin shows nothing of itself, its menu included.
        site.update(available_apps=[], is_nav_sidebar_enabled=False)
    return TemplateResponse(request, f"operators/{template}", {**site, "title": title, **context})


def _locked(request: HttpRequest) -> HttpResponse:
    logout(request)
    return locked_out(request)


def second_step(request: HttpRequest) -> HttpResponse:
    """A code from the authenticator app, a recovery code, or a security key."""
    if not _staff(request):
        return _to_login(request)
    user = request.user
    if second_factor.is_verified(user):
        return HttpResponseRedirect(_next(request))
    if not second_factor.has_device(user):
        return HttpResponseRedirect(reverse("operators:enrol"))
    error = ""
    if request.method == "POST":
        result = second_factor.verify_code(request, user, request.POST.get("code", ""))
        if result.passed:
            return HttpResponseRedirect(_next(request))
        if result.locked:
            return _locked(request)
        error = "That code is not right (or was used already)."
    summary = second_factor.device_summary(user)
    return _page(
        request,
        "second_step.html",
        "Second step",
        error=error,
        next=_next(request),
        has_totp=bool(summary["totp"]),
        has_passkeys=bool(summary["passkeys"]),
        recovery_left=summary["recovery_left"],
    )


def enrol(request: HttpRequest) -> HttpResponse:
    """Set up an authenticator app (TOTP): before the first admin page for a staff member
    without a device, and from the security page for one who passed the second step."""
    if not _staff(request):
        return _to_login(request)
    user = request.user
    first = not second_factor.has_device(user)
    if not first and not second_factor.is_verified(user):
        return HttpResponseRedirect(reverse("operators:second_step"))
    key = request.session.get(PENDING_TOTP) or second_factor.new_totp_key()
    request.session[PENDING_TOTP] = key
    error = ""
    if request.method == "POST":
        step = second_factor.code_matches(key, request.POST.get("code", ""))
        if step is not None:
            device = second_factor.enrol_totp(
                user, key, name=request.POST.get("name", "") or "authenticator", used_step=step
            )
            del request.session[PENDING_TOTP]
            if not second_factor.is_verified(user):
                second_factor.passed(request, user, device, "TOTP enrolment")
            codes = second_factor.new_recovery_codes(user) if first else []
            if not codes:
                messages.success(request, "The authenticator app is added.")
                return HttpResponseRedirect(reverse("operators:security"))
            return _recovery_page(request, codes, _next(request))
        error = "That code does not fit: check the phone's clock and try the next one."
    uri = second_factor.totp_uri(user, key)
    return _page(
        request,
        "enrol.html",
        "Set up a second factor",
        first=first,
        error=error,
        next=_next(request),
        secret=second_factor.secret_base32(key),
        uri=uri,
        qr_src=segno.make(uri, error="m").svg_data_uri(scale=4),
    )


def _recovery_page(request: HttpRequest, codes: list[str], next_url: str) -> HttpResponse:
    response = _page(
        request, "recovery_codes.html", "Your recovery codes", codes=codes, next=next_url
    )
    response["Cache-Control"] = "no-store"
    return response


def security(request: HttpRequest) -> HttpResponse:
    """The staff member's own devices, new recovery codes, and logging out everywhere."""
    if not _staff(request):
        return _to_login(request)
    user = request.user
    if request.method == "POST":
        action = request.POST.get("action", "")
        if action == "recovery_codes":
            return _recovery_page(
                request, second_factor.new_recovery_codes(user), reverse("operators:security")
            )
        if action == "remove" and second_factor.remove_device(user, request.POST.get("device", "")):
            messages.success(request, "The device is removed.")
        elif action == "end_sessions":
            sessions.end_everywhere(user, keep=request, reason="logged out everywhere")
            messages.success(request, "Every other session of yours has ended.")
        return HttpResponseRedirect(reverse("operators:security"))
    return _page(
        request,
        "security.html",
        "Sign-in security",
        required=second_factor.is_required(user),
        **second_factor.device_summary(user),
    )


# ----------------------------------------------------------------------------- WebAuthn (JSON)
def _may_register_passkey(request: HttpRequest) -> bool:
    user = request.user
    return _staff(request) and (
        second_factor.is_verified(user) or not second_factor.has_device(user)
    )


@require_POST
def passkey_registration_options(request: HttpRequest) -> HttpResponse:
    if not _may_register_passkey(request):
        return JsonResponse({"error": "pass the second step first"}, status=403)
    return HttpResponse(passkeys.registration_options(request), content_type="application/json")


@require_POST
def passkey_register(request: HttpRequest) -> HttpResponse:
    if not _may_register_passkey(request):
        return JsonResponse({"error": "pass the second step first"}, status=403)
    user = request.user
    first = not second_factor.has_device(user)
    try:
        body = json.loads(request.body)
        key = passkeys.register(request, json.dumps(body["credential"]), str(body.get("name", "")))
    except (ValueError, KeyError, TypeError, passkeys.PasskeyError) as error:
        return JsonResponse({"error": f"the key was not added: {error}"}, status=400)
    if not second_factor.is_verified(user):
        second_factor.passed(request, user, key, "security key enrolment")
    if first:
        codes = second_factor.new_recovery_codes(user)
        request.session["operators_show_codes"] = codes
        return JsonResponse({"next": reverse("operators:recovery_codes")})
    messages.success(request, "The security key is added.")
    return JsonResponse({"next": reverse("operators:security")})


def recovery_codes(request: HttpRequest) -> HttpResponse:
    """The codes made with a first passkey, shown once (they are not kept readable)."""
    if not _staff(request) or not second_factor.is_verified(request.user):
        return _to_login(request)
    codes = request.session.pop("operators_show_codes", None)
    if not codes:
        return HttpResponseRedirect(reverse("operators:security"))
    return _recovery_page(request, list(codes), reverse("admin:index"))


@require_POST
def passkey_options(request: HttpRequest) -> HttpResponse:
    if not _staff(request):
        return JsonResponse({"error": "log in first"}, status=403)
    return HttpResponse(passkeys.authentication_options(request), content_type="application/json")


@require_POST
def passkey_verify(request: HttpRequest) -> HttpResponse:
    if not _staff(request):
        return JsonResponse({"error": "log in first"}, status=403)
    try:
        body = json.loads(request.body)
        credential, next_url = json.dumps(body["credential"]), str(body.get("next", ""))
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "malformed request"}, status=400)
    result = passkeys.authenticate(request, credential)
    if result.passed:
        safe = next_url and url_has_allowed_host_and_scheme(
            next_url, allowed_hosts={request.get_host()}, require_https=request.is_secure()
        )
        return JsonResponse({"next": next_url if safe else reverse("admin:index")})
    if result.locked:
        logout(request)
        return JsonResponse({"error": "locked", "next": reverse("admin:login")}, status=429)
    return JsonResponse({"error": "The security key was not accepted."}, status=400)
