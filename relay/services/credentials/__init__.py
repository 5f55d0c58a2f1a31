"""Provider credentials of an app: validation, provider configs, display, expiry and rotation.

One place decides what a valid credential is, so the admin form and `load_tenants` reject the
same things with the same words, and the provider registry builds its configs from it.
Secrets never leave this package in a message: errors name the field and the problem, and the
admin shows a fingerprint (`stored.credential_fingerprint`) instead of the value.

Modules: `stored` (reading a stored value), `configs` (provider configs), `validation`,
`selectors` (admin and checks), `keys` (status and rotation of the keys at rest).
"""
