"""Firebase Cloud Messaging as the relay plugs it in: its credentials and how they make a client."""

from __future__ import annotations

import json
from typing import Any

from relay.providers.base import PushProvider
from relay.providers.payloads import fcm_payload
from relay.providers.spec import BuildContext, CredentialField, ProviderSpec, Values


def _configured(values: Values) -> bool:
    return bool(str(values.get("service_account") or "").strip())


def _validate(values: Values) -> dict[str, str]:
    from relay.providers.fcm import FcmConfig

    if not _configured(values):
        return {}
    try:
        FcmConfig.parse(str(values["service_account"]), str(values.get("endpoint") or ""))
    except ValueError as error:
        return {"endpoint" if "endpoint" in str(error) else "service_account": str(error)}
    return {}


def _build(values: Values, context: BuildContext) -> PushProvider:
    from relay.providers.fcm import FcmConfig, FcmProvider

    config = FcmConfig.parse(str(values["service_account"]), str(values.get("endpoint") or ""))
    # The CA bundle's settings (REQUESTS_CA_BUNDLE, else CURL_CA_BUNDLE) reach the provider here.
    ca_bundle = context.setting("requests_ca_bundle") or context.setting("curl_ca_bundle") or ""
    return FcmProvider(
        config, timeout=context.timeout, payload=context.payload, ca_bundle=str(ca_bundle)
    )


def _summary(values: Values) -> list[tuple[str, str]]:
    """The project id, read cheaply (no key loading: lists show many apps)."""
    try:
        info: Any = json.loads(str(values.get("service_account") or ""))
    except ValueError:
        return []
    project = info.get("project_id") if isinstance(info, dict) else None
    return [("FCM project", project)] if isinstance(project, str) and project else []


SPEC = ProviderSpec(
    service="fcm",
    label="Firebase Cloud Messaging",
    code="FCM",
    fields=(
        CredentialField(
            "service_account",
            "Service account JSON",
            "secret_text",
            help="The Firebase service account JSON of this app.",
            upload=".json,application/json",
            required=True,
        ),
        CredentialField(
            "endpoint",
            "Endpoint",
            "url",
            help="FCM base URL; empty means https://fcm.googleapis.com.",
        ),
    ),
    configured=_configured,
    validate=_validate,
    build=_build,
    summary=_summary,
    payload=fcm_payload,
)
