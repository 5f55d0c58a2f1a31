"""Provider credentials of an app: one encrypted record per app and provider, validation,
display, expiry and rotation.

Which fields a provider has, and what makes them valid, is the provider's own spec
(`relay/providers/<name>/spec.py`); this package runs it, so the admin form and `load_tenants`
reject the same things with the same words, and the provider registry builds clients from
what it reads. Secrets never leave this package in a message: errors name the field and the
problem, and the admin shows a fingerprint (`stored.credential_fingerprint`) instead of the
value.

Modules: `records` (reading and replacing an app's records), `validation`, `stored` (a stored
value and its fingerprint), `selectors` (admin and checks), `keys` (status and rotation of the
keys at rest).
"""
