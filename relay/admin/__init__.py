"""The Django admin: where the hosting provider's staff run the service, and where a tenant's
own staff look after their part and nothing else.

- Every tenant-owned model's admin derives from `TenantScopedAdmin`: lists, forms, choice
  lists, list filters, searches, actions and object pages only reach the rows of the user's
  tenants (`relay.services.tenancy`). Admins of other models are `OperatorOnlyAdmin`.
- Credentials are write-only (`relay.forms.AppForm`, `ComponentForm`); change messages in the
  history list field names, never values. Tokens and registration secrets are never shown.
- Registrations are found by node or account domain: there is no JID to search by, and the
  admin must not invent one.

One module per thing administered: tenants, applications (apps and their credentials),
components, registrations, deliveries (and dead letters), staff (the operator's own pages),
reports; `base` holds the building blocks. The site itself (`relay.admin_site`),
its charts and its AppConfig stay outside this package: Django imports the site while it sets
up `admin.site`, and importing anything inside this package first registers every part, which
would set up a second site.
"""

# Django's admin autodiscovery imports this package: importing the parts registers them.
from relay.admin import (  # noqa: F401
    applications,
    components,
    deliveries,
    registrations,
    staff,
    tenants,
)
