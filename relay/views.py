"""Probes for load balancers: thin, the checks themselves live in `relay.services.health`."""

from django.http import HttpRequest, JsonResponse

from relay.services import health


def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness: the process answers."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """Readiness: the database and the broker are reachable."""
    checks = health.readiness()
    ready = all(checks.values())
    return JsonResponse(
        {"status": "ok" if ready else "unavailable", "checks": checks}, status=200 if ready else 503
    )
