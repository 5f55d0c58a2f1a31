"""Existing groups get the audit trail's permissions: tenant staff groups may view their
tenant's audit entries (new ones get it from `tenancy.create_staff_group`), and the
"Operators" group (relay 0004) may view every entry and change tenants' security policies."""

from django.contrib.auth.management import create_permissions
from django.db import migrations


def grant(apps, schema_editor):
    operators = apps.get_app_config("operators")
    # Permissions are normally created after all migrations ran; the groups need them now.
    operators.models_module = True
    create_permissions(operators, verbosity=0, apps=apps)
    operators.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    view = Permission.objects.filter(content_type__app_label="operators", codename="view_auditentry")
    for group in Group.objects.filter(tenant_binding__isnull=False):
        group.permissions.add(*view)
    every = Permission.objects.filter(content_type__app_label="operators")
    for group in Group.objects.filter(name="Operators", tenant_binding__isnull=True):
        group.permissions.add(*every)


class Migration(migrations.Migration):
    dependencies = [
        ("operators", "0001_initial"),
        ("relay", "0004_operator_permission"),
    ]

    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
