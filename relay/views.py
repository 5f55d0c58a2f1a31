"""Probes for load balancers: thin, the checks themselves live in `relay.services.health`."""

from django.http import HttpRequest, HttpResponse, JsonResponse

from relay import conf, metrics
from relay.services import health, observability


def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness: the process answers."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """Readiness: the database, the broker, the throttling store and the cache answer."""
    checks = health.web_readiness()
    ready = all(checks.values())
    return JsonResponse(
        {"status": "ok" if ready else "unavailable", "checks": checks}, status=200 if ready else 503
    )


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus: every web worker's counters added up, and the stored state."""
    authorization = request.headers.get("Authorization", "")
    if not metrics.token_accepted(conf.current().metrics_token, authorization):
        return HttpResponse(status=401, headers={"WWW-Authenticate": "Bearer"})
    scraped = metrics.registry(metrics.StateCollector(observability.read_state))
    return HttpResponse(metrics.render(scraped), content_type=metrics.CONTENT_TYPE)
