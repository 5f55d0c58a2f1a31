"""Fuzzing the Windows API from its own OpenAPI schema: no 500, no crash, no undeclared answer.

Request bodies come from the served schema (`from_schema` below turns its JSON Schema into a
hypothesis strategy), from those messages with one part broken, from realistic messages with
random JIDs and channel URIs, from arbitrary JSON and from arbitrary bytes. Every answer must
have a status the operation declares and a body that validates against the schema declared for
that status. The TLS listener's frame handler gets the same treatment: whatever the bytes, it
answers in the UWPX shape.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any
from urllib.parse import quote

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.windows.api import protocol

pytestmark = [pytest.mark.django_db, pytest.mark.defaults]

FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,  # no example files in the checkout; failures print their example
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
BASE = "/api/v1/apps/{app_key}/uwpx"
OPERATIONS = ["", "/set_channel_uri", "/set_accounts", "/request_test_push"]
KNOWN_DEVICE = "ab" * 32
STATUSES: dict[str, int] = {}  # what the fuzz reached, printed at the end (pytest -s)


def resolve(node: Any, components: dict[str, Any]) -> Any:
    """Inline the schema's $refs and drop OpenAPI-only keywords (JSON Schema tools want that)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return resolve(components[node["$ref"].rsplit("/", 1)[-1]], components)
        return {
            key: resolve(value, components)
            for key, value in node.items()
            if key not in ("discriminator",)
        }
    if isinstance(node, list):
        return [resolve(item, components) for item in node]
    return node


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    from relay.windows.api.views import api

    return json.loads(json.dumps(api.get_openapi_schema()))  # as served: string status keys


@pytest.fixture
def fuzz_setup(client, component, settings, openapi):
    """No rate limits (they would turn the fuzz into 429s), one known device with an account."""
    settings.RELAY = settings.RELAY | {
        "UWPX_RATE_LIMIT_ADDRESS": (0, 60),
        "UWPX_RATE_LIMIT_DEVICE": (0, 60),
        "UWPX_RATE_LIMIT_TEST_PUSH": (0, 60),
    }
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "LOCATION": f"fuzz-{uuid.uuid4()}",
        }
    }
    app = component.app
    from relay.windows import services as uwpx

    uwpx.set_channel_uri(
        app=app, device_id=KNOWN_DEVICE, channel_uri="https://db5p.notify.windows.com/?token=x"
    )
    uwpx.set_accounts(
        app=app, device_id=KNOWN_DEVICE, accounts=[uwpx.AccountRef(bare_jid="a@example.org")]
    )
    return client, app


def check_answer(openapi: dict[str, Any], path: str, response) -> None:
    operation = openapi["paths"][path]["post"]
    status = str(response.status_code)
    STATUSES[status] = STATUSES.get(status, 0) + 1
    assert response.status_code != 500, response.content[:500]
    assert status in operation["responses"], (status, response.content[:500])
    body = response.json()
    schema = resolve(
        operation["responses"][status]["content"]["application/json"]["schema"],
        openapi["components"]["schemas"],
    )
    jsonschema.validate(body, schema)
    assert body["version"] == 1 and body["action"] == "response"
    assert body["status"] == (1 if response.status_code == 200 else 0)


def send(client, app_key: str, suffix: str, body: bytes):
    return client.post(
        BASE.format(app_key=quote(app_key, safe="")) + suffix,
        data=body,
        content_type="application/json",
    )


def request_schema(openapi: dict[str, Any], path: str) -> dict[str, Any]:
    operation = openapi["paths"][path]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    return resolve(schema, openapi["components"]["schemas"])


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Instances of the JSON Schema features our OpenAPI document uses; anything else fails
    loudly, so the fuzz cannot silently stop covering a field the schema grows."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return st.one_of([from_schema(option) for option in schema[key]])
    kind = schema.get("type")
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=min(schema.get("maxLength", 60), low + 60))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema["items"]), max_size=min(schema.get("maxItems", 5), 5))
    if kind == "object":
        required = set(schema.get("required", ()))
        properties = schema.get("properties", {})
        return st.fixed_dictionaries(
            {name: from_schema(sub) for name, sub in properties.items() if name in required},
            optional={
                name: from_schema(sub) for name, sub in properties.items() if name not in required
            },
        )
    raise AssertionError(f"the fuzz does not know this schema yet: {schema}")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def broken(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A valid message with one key removed, replaced or added."""
    message = copy.deepcopy(draw(valid))
    how = draw(st.sampled_from(["drop", "replace", "add", "device"]))
    keys = sorted(message)
    if how == "drop" and keys:
        del message[draw(st.sampled_from(keys))]
    elif how == "replace" and keys:
        message[draw(st.sampled_from(keys))] = draw(json_values)
    elif how == "device":
        message["device_id"] = KNOWN_DEVICE
    else:
        message[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
    return message


jids = st.one_of(
    st.text(max_size=30),
    st.builds(
        lambda user, domain, resource: f"{user}@{domain}{resource}",
        st.text(max_size=12),
        st.text(max_size=20),
        st.sampled_from(["", "/r", "/"]),
    ),
    st.from_regex(r"\A[a-z]{1,8}@[a-z]{1,8}\.(org|de|com)\Z"),
)
channels = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda scheme, sub, rest: f"{scheme}://{sub}.notify.windows.com/{rest}",
        st.sampled_from(["https", "http", "HTTPS", "ftp"]),
        st.text(max_size=12),
        st.text(max_size=20),
    ),
)
realistic = st.one_of(
    st.fixed_dictionaries(
        {
            "version": st.just(1),
            "action": st.just("set_channel_uri"),
            "device_id": st.just(KNOWN_DEVICE),
            "channel_uri": channels,
        }
    ),
    st.fixed_dictionaries(
        {
            "version": st.just(1),
            "action": st.sampled_from(["set_accounts", "set_push_accounts"]),
            "device_id": st.just(KNOWN_DEVICE),
            "accounts": st.lists(
                st.one_of(
                    st.fixed_dictionaries({"bare_jid": jids}),
                    st.fixed_dictionaries(
                        {"account_id": st.from_regex(r"\A[0-9a-f]{64}\Z") | st.text(max_size=70)}
                    ),
                ),
                max_size=5,
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "version": st.just(1),
            "action": st.just("request_test_push"),
            "device_id": st.just(KNOWN_DEVICE),
        }
    ),
)


@pytest.mark.parametrize("suffix", OPERATIONS)
def test_schema_generated_and_broken_messages(fuzz_setup, openapi, suffix, send_queue):
    client, app = fuzz_setup
    path = BASE + suffix
    valid = from_schema(request_schema(openapi, path))

    @FUZZ
    @given(message=st.one_of(valid, broken(valid), realistic))
    def run(message: dict[str, Any]) -> None:
        response = send(client, app.public_key, suffix, json.dumps(message).encode())
        check_answer(openapi, path, response)

    run()
    print(f"fuzz {suffix or '/'}: answers by status so far {sorted(STATUSES.items())}")


@pytest.mark.parametrize("suffix", OPERATIONS)
def test_arbitrary_json_bytes_and_app_keys(fuzz_setup, openapi, suffix):
    client, app = fuzz_setup
    path = BASE + suffix
    app_keys = st.just(app.public_key) | st.text(min_size=1, max_size=40).filter(
        lambda key: "/" not in key
    )
    bodies = st.one_of(
        json_values.map(lambda value: json.dumps(value).encode()),
        st.binary(max_size=200),
    )

    @FUZZ
    @given(app_key=app_keys, body=bodies)
    def run(app_key: str, body: bytes) -> None:
        check_answer(openapi, path, send(client, app_key, suffix, body))

    run()


def test_listener_frames_always_get_a_uwpx_answer(fuzz_setup, send_queue):
    _client, app = fuzz_setup
    frames = st.one_of(
        st.binary(max_size=300),
        json_values.map(lambda value: json.dumps(value).encode()),
        realistic.map(lambda value: json.dumps(value).encode()),
    )

    @FUZZ
    @given(frame=frames)
    def run(frame: bytes) -> None:
        answer = protocol.handle_frame(
            app_key=app.public_key, frame=frame, client_address="192.0.2.1"
        )
        assert answer["version"] == 1 and answer["action"] == "response"
        assert answer["status"] in (0, 1)
        assert (answer["status"] == 0) == ("error" in answer)
        if answer["status"] == 0:
            assert answer["error"] != protocol.INTERNAL_ERROR
        json.dumps(answer)

    run()
