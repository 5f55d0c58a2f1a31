"""The operators' own security: a second factor for staff, the audit trail, sessions that end.

- `services.second_factor`: who must pass a second step (every operator; a tenant's staff as
  its policy says), enrolling TOTP devices and recovery codes (django-otp), resetting them.
- `services.passkeys`: WebAuthn security keys and passkeys (py_webauthn) as django-otp devices.
- `services.audit`: one `AuditEntry` per change of the audited models, whatever made it, and
  per login, failed second step and device change.
- `services.sessions`: idle timeout, absolute lifetime, ending a staff member's sessions.
- `middleware`: puts the request's actor in the audit context, ends stale sessions, and lets
  no admin page answer before the second step.

Why django-otp and py_webauthn: django-otp is the device framework the Django admin's 2FA
packages build on (a verified-session middleware, TOTP with replay protection and drift,
recovery codes, per-device backoff) and leaves the login to the admin's own view, which
django-axes already guards; django-allauth's MFA would replace the whole login, and
django-two-factor-auth its own wizard. py_webauthn (Duo) verifies WebAuthn ceremonies with no
framework attached, so passkeys are one small django-otp device here.
"""
