"""Security keys and passkeys (WebAuthn) as a second factor, through py_webauthn.

The relying party is this site: its ID is the host the admin is reached on (without port) and
the expected origin is the request's own scheme and host, so the admin works on whatever name
it is served under. The challenge of a ceremony is kept in the session until it is answered.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from django.db import transaction
from django.http import HttpRequest
from webauthn import (
    generate_authentication_options,
    generate_registration_options,
    options_to_json,
    verify_authentication_response,
    verify_registration_response,
)
from webauthn.helpers import base64url_to_bytes, bytes_to_base64url
from webauthn.helpers.exceptions import WebAuthnException
from webauthn.helpers.structs import (
    AuthenticatorSelectionCriteria,
    AuthenticatorTransport,
    PublicKeyCredentialDescriptor,
    ResidentKeyRequirement,
    UserVerificationRequirement,
)

from relay.operators.models import WebAuthnKey
from relay.operators.services import second_factor

log = logging.getLogger(__name__)

REGISTRATION_CHALLENGE = "operators_webauthn_registration"
AUTHENTICATION_CHALLENGE = "operators_webauthn_authentication"
RP_NAME = "Push relay admin"


class PasskeyError(Exception):
    """The browser's answer did not verify (wrong origin, challenge, signature, ...)."""


def relying_party(request: HttpRequest) -> tuple[str, str]:
    """(RP ID, origin) of the site as the browser sees it."""
    host = request.get_host()
    rp_id = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    rp_id = rp_id.strip("[]")
    return rp_id, f"{request.scheme}://{host}"


def _descriptors(user: Any) -> list[PublicKeyCredentialDescriptor]:
    return [
        PublicKeyCredentialDescriptor(
            id=base64url_to_bytes(key.credential_id),
            transports=[AuthenticatorTransport(t) for t in key.transports if _known(t)],
        )
        for key in WebAuthnKey.objects.filter(user=user, confirmed=True)
    ]


def _known(transport: str) -> bool:
    return transport in {t.value for t in AuthenticatorTransport}


def registration_options(request: HttpRequest) -> str:
    """The options for navigator.credentials.create() (JSON), for the logged-in user."""
    user = request.user
    rp_id, _ = relying_party(request)
    options = generate_registration_options(
        rp_id=rp_id,
        rp_name=RP_NAME,
        user_id=str(user.pk).encode(),
        user_name=user.get_username(),
        exclude_credentials=_descriptors(user),
        authenticator_selection=AuthenticatorSelectionCriteria(
            resident_key=ResidentKeyRequirement.PREFERRED,
            user_verification=UserVerificationRequirement.PREFERRED,
        ),
    )
    request.session[REGISTRATION_CHALLENGE] = bytes_to_base64url(options.challenge)
    return str(options_to_json(options))


@transaction.atomic
def register(request: HttpRequest, credential: str, name: str) -> WebAuthnKey:
    """Verify the browser's new credential and keep it as a device of the user."""
    challenge = request.session.pop(REGISTRATION_CHALLENGE, None)
    if not challenge:
        raise PasskeyError("no registration was started")
    rp_id, origin = relying_party(request)
    try:
        verified = verify_registration_response(
            credential=credential,
            expected_challenge=base64url_to_bytes(challenge),
            expected_rp_id=rp_id,
            expected_origin=origin,
        )
    except (WebAuthnException, ValueError, KeyError) as error:
        raise PasskeyError(str(error)) from error
    transports = json.loads(credential).get("response", {}).get("transports", []) or []
    key: WebAuthnKey = WebAuthnKey.objects.create(
        user=request.user,
        name=(name or "security key")[:64],
        credential_id=bytes_to_base64url(verified.credential_id),
        public_key=bytes_to_base64url(verified.credential_public_key),
        sign_count=verified.sign_count,
        transports=[t for t in transports if isinstance(t, str)][:8],
        confirmed=True,
    )
    return key


def authentication_options(request: HttpRequest) -> str:
    """The options for navigator.credentials.get() (JSON): the user's own keys only."""
    rp_id, _ = relying_party(request)
    options = generate_authentication_options(
        rp_id=rp_id,
        allow_credentials=_descriptors(request.user),
        user_verification=UserVerificationRequirement.PREFERRED,
    )
    request.session[AUTHENTICATION_CHALLENGE] = bytes_to_base64url(options.challenge)
    return str(options_to_json(options))


def authenticate(request: HttpRequest, credential: str) -> second_factor.StepResult:
    """The second step by a security key or passkey; a failure counts like a wrong code."""
    user = request.user
    if second_factor.is_locked(request, user):
        return second_factor.StepResult(passed=False, locked=True)
    challenge = request.session.pop(AUTHENTICATION_CHALLENGE, None)
    try:
        raw_id = str(json.loads(credential)["rawId"])
    except (ValueError, KeyError, TypeError):
        return second_factor.failed(request, user, "malformed security key answer")
    key = WebAuthnKey.objects.filter(user=user, confirmed=True, credential_id=raw_id).first()
    if challenge is None or key is None:
        return second_factor.failed(request, user, "unknown security key")
    rp_id, origin = relying_party(request)
    try:
        verified = verify_authentication_response(
            credential=credential,
            expected_challenge=base64url_to_bytes(challenge),
            expected_rp_id=rp_id,
            expected_origin=origin,
            credential_public_key=base64url_to_bytes(key.public_key),
            credential_current_sign_count=key.sign_count,
        )
    except (WebAuthnException, ValueError, KeyError) as error:
        log.warning("admin.passkey_refused", extra={"reason": type(error).__name__})
        return second_factor.failed(request, user, "security key refused")
    key.sign_count = verified.new_sign_count
    key.save(update_fields=["sign_count"])
    key.set_last_used_timestamp(commit=True)
    second_factor.passed(request, user, key, "security key")
    return second_factor.StepResult(passed=True, method="security key")
