"""The second step after the password, through django-otp: TOTP devices (RFC 6238 apps),
single-use recovery codes (a static device), and security keys or passkeys
(`services.passkeys`, WebAuthn devices of the same framework).

Who must pass it: every operator (superusers and holders of the operator permission) and every
staff member confined to no tenant; a tenant's own staff when their tenant's policy says so
(`TenantSecurityPolicy`, required unless an operator turned it off for every tenant they
belong to). Failed second steps count as failed logins for django-axes (same username and
address pair, same lockout), and a login only clears axes' failures once the second step is
passed.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import django_otp
from axes.handlers.proxy import AxesProxyHandler
from axes.utils import reset as axes_reset
from django.contrib.auth.signals import user_login_failed
from django.db import transaction
from django.http import HttpRequest
from django_otp.oath import TOTP
from django_otp.plugins.otp_static.models import StaticDevice, StaticToken
from django_otp.plugins.otp_totp.models import TOTPDevice, default_key

from relay.operators.models import AuditAction, TenantSecurityPolicy, WebAuthnKey
from relay.operators.services import audit
from relay.services import login_throttle, tenancy

log = logging.getLogger(__name__)

RECOVERY_DEVICE_NAME = "recovery codes"
RECOVERY_CODES = 10
ISSUER = "Push relay"


def is_required(user: Any) -> bool:
    """Must this staff member pass a second step to use the admin?"""
    if not user.is_authenticated:
        return False
    tenant_ids = tenancy.tenant_ids_for(user)
    if tenant_ids is None or not tenant_ids:
        return True  # operators; and staff of no tenant fail closed
    relaxed = set(
        TenantSecurityPolicy.objects.filter(
            tenant_id__in=tenant_ids, second_factor_required=False
        ).values_list("tenant_id", flat=True)
    )
    return relaxed != set(tenant_ids)


def has_device(user: Any) -> bool:
    return django_otp.user_has_device(user, confirmed=True)


def is_verified(user: Any) -> bool:
    return bool(getattr(user, "is_verified", lambda: False)())


def device_summary(user: Any) -> dict[str, Any]:
    """What the security page lists: names, kinds and the recovery codes left (a count)."""
    recovery = StaticDevice.objects.filter(user=user, name=RECOVERY_DEVICE_NAME).first()
    return {
        "totp": list(TOTPDevice.objects.filter(user=user, confirmed=True).order_by("id")),
        "passkeys": list(WebAuthnKey.objects.filter(user=user, confirmed=True).order_by("id")),
        "recovery_left": recovery.token_set.count() if recovery is not None else 0,
    }


# --------------------------------------------------------------------------------- enrolling
def new_totp_key() -> str:
    """A fresh secret (hex), kept in the session until the user confirms a code from it."""
    key: str = default_key()
    return key


def totp_uri(user: Any, key_hex: str) -> str:
    """The otpauth:// URI an authenticator app scans (the same as TOTPDevice.config_url)."""
    device = TOTPDevice(user=user, key=key_hex, name="authenticator")
    return str(device.config_url)


def secret_base32(key_hex: str) -> str:
    import base64

    return base64.b32encode(bytes.fromhex(key_hex)).decode().rstrip("=")


def code_matches(key_hex: str, code: str) -> int | None:
    """The time step `code` fits for the pending secret (one step of drift either way), or
    None: kept as the device's last step, so the enrolment's code cannot be replayed."""
    code = code.strip().replace(" ", "")
    if not code.isdigit() or len(code) > 8:
        return None
    totp = TOTP(bytes.fromhex(key_hex), step=30, digits=6)
    if not totp.verify(int(code), tolerance=1):
        return None
    return int(totp.t())  # the drift it matched with included


@transaction.atomic
def enrol_totp(
    user: Any, key_hex: str, *, name: str = "authenticator", used_step: int = -1
) -> TOTPDevice:
    """A confirmed TOTP device for `user` from the secret they proved to hold."""
    device: TOTPDevice = TOTPDevice.objects.create(
        user=user, name=name[:64], key=key_hex, confirmed=True, last_t=used_step
    )
    return device


@transaction.atomic
def new_recovery_codes(user: Any) -> list[str]:
    """Ten fresh single-use codes; the previous ones stop working. Shown once."""
    StaticDevice.objects.filter(user=user, name=RECOVERY_DEVICE_NAME).delete()
    device = StaticDevice.objects.create(user=user, name=RECOVERY_DEVICE_NAME, confirmed=True)
    codes = [_recovery_code() for _ in range(RECOVERY_CODES)]
    StaticToken.objects.bulk_create(StaticToken(device=device, token=code) for code in codes)
    return codes


def _recovery_code() -> str:
    alphabet = "abcdefghjkmnpqrstuvwxyz23456789"
    raw = "".join(secrets.choice(alphabet) for _ in range(10))
    return f"{raw[:5]}-{raw[5:]}"


@transaction.atomic
def reset_devices(user: Any) -> int:
    """Remove every second factor of `user` (a lost phone or key): they enrol anew at their
    next login. Returns how many devices went."""
    removed = 0
    for model in (TOTPDevice, StaticDevice, WebAuthnKey):
        for device in model.objects.filter(user=user):
            device.delete()
            removed += 1
    return removed


def remove_device(user: Any, device_id: str) -> bool:
    """Remove one of the user's own devices, named by its persistent id."""
    for device in django_otp.devices_for_user(user, confirmed=None):
        if device.persistent_id == device_id:
            device.delete()
            return True
    return False


# ----------------------------------------------------------------------------- the second step
@dataclass(frozen=True, slots=True)
class StepResult:
    passed: bool
    locked: bool = False
    method: str = ""


def is_locked(request: HttpRequest, user: Any) -> bool:
    return bool(AxesProxyHandler.is_locked(request, {"username": user.get_username()}))


def verify_code(request: HttpRequest, user: Any, code: str) -> StepResult:
    """Check a TOTP code or a recovery code; a failure counts against the login's lockout."""
    if is_locked(request, user):
        return StepResult(passed=False, locked=True)
    code = code.strip().replace(" ", "")
    device = _matching_device(user, code) if code else None
    if device is None:
        return failed(request, user, "wrong code")
    method = "recovery code" if isinstance(device, StaticDevice) else "TOTP"
    passed(request, user, device, method)
    return StepResult(passed=True, method=method)


def _matching_device(user: Any, code: str) -> Any:
    with transaction.atomic():
        candidates: Iterable[Any] = [
            *TOTPDevice.objects.devices_for_user(user, confirmed=True).select_for_update(),
            *StaticDevice.objects.devices_for_user(user, confirmed=True).select_for_update(),
        ]
        for device in candidates:
            allowed, _ = device.verify_is_allowed()
            if allowed and device.verify_token(code):
                return device
    return None


def passed(request: HttpRequest, user: Any, device: Any, method: str) -> None:
    """The second step is done: the session is verified and the login's failures cleared."""
    django_otp.login(request, device)
    axes_reset(ip=login_throttle.client_address(request), username=user.get_username())
    audit.record(AuditAction.SECOND_STEP_PASSED, obj=user, detail=method)
    log.info("admin.second_step_passed", extra={"method": method})


def failed(request: HttpRequest, user: Any, detail: str) -> StepResult:
    """A failed second step: audited, and counted by axes like a wrong password."""
    audit.record(AuditAction.SECOND_STEP_FAILED, obj=user, detail=detail)
    user_login_failed.send(
        sender=__name__,
        credentials={"username": user.get_username(), "relay_second_step": True},
        request=request,
    )
    log.warning("admin.second_step_failed")
    return StepResult(passed=False, locked=is_locked(request, user))


def password_accepted(request: HttpRequest, user: Any) -> None:
    """After the password: a login that needs no second step is complete, so axes' failures
    for it are cleared now (`AXES_RESET_ON_SUCCESS` is off: a password alone must not wipe
    failed second steps)."""
    if not is_required(user):
        axes_reset(ip=login_throttle.client_address(request), username=user.get_username())
