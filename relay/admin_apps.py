"""Installs the relay's admin site as Django's default one (see `relay.admin_site`).

Kept apart from `admin_site` because this module is imported while apps are still loading.
"""

from django.contrib.admin.apps import AdminConfig


class RelayAdminConfig(AdminConfig):
    default_site = "relay.admin_site.RelayAdminSite"
