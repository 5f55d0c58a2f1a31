"""The operators' security on every request: the audit's actor, sessions that end, and no
admin page before the second step."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlencode

from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse

from relay.operators.services import audit, second_factor, sessions

Handler = Callable[[HttpRequest], HttpResponse]


def _admin_prefix() -> str:
    return reverse("admin:index")


class AuditContextMiddleware:
    """Whatever this request changes is recorded as the requesting user's, from its address."""

    def __init__(self, get_response: Handler) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with audit.request_context(request):
            return self.get_response(request)


class SessionLimitsMiddleware:
    """Ends an admin session that sat idle too long, outlived its lifetime, or was ended
    everywhere (`services.sessions`). Only sessions of a logged-in user are looked at."""

    def __init__(self, get_response: Handler) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if "_auth_user_id" in request.session:
            sessions.enforce(request)
        return self.get_response(request)


class SecondFactorMiddleware:
    """Nothing of the admin answers a staff member who must pass the second step until they
    have: they are sent to it, or to enrol a device if they have none. Only the login and
    logout pages and the second step's own pages are open before."""

    OPEN_NAMES = ("admin:login", "admin:logout")

    def __init__(self, get_response: Handler) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        prefix = _admin_prefix()
        path = request.path_info
        if not path.startswith(prefix) or "_auth_user_id" not in request.session:
            return self.get_response(request)
        if path in {reverse(name) for name in self.OPEN_NAMES} or path.startswith(
            reverse("operators:second_step")
        ):
            return self.get_response(request)
        user = request.user
        if (
            not user.is_authenticated
            or second_factor.is_verified(user)
            or not second_factor.is_required(user)
        ):
            return self.get_response(request)
        target = "operators:second_step" if second_factor.has_device(user) else "operators:enrol"
        query = urlencode({"next": request.get_full_path()}) if request.method == "GET" else ""
        return HttpResponseRedirect(reverse(target) + (f"?{query}" if query else ""))
