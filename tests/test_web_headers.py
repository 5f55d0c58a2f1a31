"""The same security headers on every answer of the web process, whichever route made it:
the admin, the API, the probes, /metrics, static files, the UnifiedPush resource (POST, GET,
DELETE, the Matrix gateway), Django's 404s and errors, and the server's own refusals. They
are what Django's middlewares add (pushsite/security.py asks them), and the server sets them
on every answer."""

from __future__ import annotations

import json
import socket

import pytest
from django.test import override_settings

from pushsite.security import security_headers
from relay.models import Tenant
from relay.unifiedpush.services import messages
from tests.support.endpoints import new_endpoint
from tests.support.processes import start_web
from tests.support.raw_http import Answer, exchange, post, request
from tests.support.unifiedpush_components import serving_unifiedpush

UWPX = json.dumps({"version": 1, "action": "set_channel_uri", "device_id": "0" * 64}).encode()


def normal(name: str, value: str) -> str:
    """django-csp writes the directives in set order (it differs between processes)."""
    if name.lower() == "content-security-policy":
        return "; ".join(sorted(part.strip() for part in value.split(";")))
    return value


def headers_of(answer: Answer) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in answer.head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        found.setdefault(name.strip().lower(), []).append(normal(name, value.strip()))
    return found


@pytest.mark.django_db(transaction=True)
def test_every_route_answers_with_the_same_security_headers(collected_static):
    messages.reset_limits()
    web, url = start_web(RELAY_UNIFIEDPUSH_ENDPOINT_RATE="0/0")
    port = int(url.rsplit(":", 1)[1])
    try:
        tenant = Tenant.objects.create(name="headers")
        component = serving_unifiedpush(
            tenant=tenant, jid="up.headers.example", secret="x", endpoint_url=url
        )
        token = new_endpoint(component).rsplit("/", 1)[1]
        json_type = "Content-Type: application/json"
        routes = {
            "admin login": request("GET", "/admin/login/"),
            "admin redirect": request("GET", "/admin/"),
            "api refusal": request("POST", "/api/v1/apps/nope/uwpx", json_type, body=UWPX),
            "api schema": request("GET", "/api/v1/openapi.json"),
            "healthz": request("GET", "/healthz"),
            "readyz": request("GET", "/readyz"),
            "metrics": request("GET", "/metrics"),
            "static": request("GET", "/static/admin/css/base.css"),
            "push post": post(token, b"hello"),
            "push get": request("GET", f"/push/{token}"),
            "push delete": request("DELETE", "/push/message/AAAAAAAAAAE.0123456789abcdef01234567"),
            "push put": request("PUT", f"/push/{token}", body=b"x"),
            "push too large": post(token, b"x" * 5000),
            "matrix get": request("GET", "/_matrix/push/v1/notify"),
            "matrix post": request("POST", "/_matrix/push/v1/notify", json_type, body=b"{"),
            "django 404": request("GET", "/nothing/here"),
            "foreign host": request("GET", "/healthz", "Host: elsewhere.example"),
            "too many fields": request("GET", "/healthz", *[f"X-{n}: {n}" for n in range(120)]),
            "request line too long": request("GET", "/healthz?" + "q" * 9000),
        }
        statuses = {}
        expected = {
            name.lower(): [normal(name, value)] for name, value in security_headers(secure=False)
        }
        assert {"content-security-policy", "x-frame-options", "x-content-type-options"} <= set(
            expected
        )
        for name, data in routes.items():
            with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
                [answer] = exchange(sock, data)
            statuses[name] = answer.status
            found = headers_of(answer)
            assert {key: found.get(key) for key in expected} == expected, name
        assert statuses == {
            "admin login": 200, "admin redirect": 302, "api refusal": 422, "api schema": 200,
            "healthz": 200, "readyz": statuses["readyz"], "metrics": 200, "static": 200,
            "push post": 201, "push get": 200, "push delete": 404, "push put": 405,
            "push too large": 413, "matrix get": 200, "matrix post": 400, "django 404": 404,
            "foreign host": 400, "too many fields": 431, "request line too long": 414,
        }  # fmt: skip
    finally:
        web.stop()


@pytest.mark.defaults
@pytest.mark.parametrize("secure", [False, True])
def test_the_headers_are_what_djangos_middlewares_add(client, secure):
    """Over HTTPS (behind the proxy) HSTS joins them; Django's own answer has each one."""
    proxy = {"SECURE_PROXY_SSL_HEADER": ("HTTP_X_FORWARDED_PROTO", "https")}
    with override_settings(SECURE_HSTS_SECONDS=3600, **proxy):
        computed = dict(security_headers(secure))
        extra = {"HTTP_X_FORWARDED_PROTO": "https"} if secure else {}
        response = client.get("/healthz", **extra)
    assert ("Strict-Transport-Security" in computed) is secure
    assert {name: normal(name, response[name]) for name in computed} == {
        name: normal(name, value) for name, value in computed.items()
    }
