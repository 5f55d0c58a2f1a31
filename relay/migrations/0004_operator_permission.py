"""Operator status becomes explicit: the `operate_all_tenants` permission and an "Operators" group.

Before, any staff user in no tenant-bound group was treated as the operator's; a tenant group
whose binding was removed thereby saw every tenant. Now a non-superuser needs this permission.

This migration creates the permission and a group "Operators" holding it together with every
permission of the relay's models. It adds nobody to it: it cannot tell the operator's staff from
a tenant group whose binding was removed, and guessing would re-open exactly that hole. After
upgrading, a superuser adds the operator's (non-superuser) staff to "Operators"; until then they
see nothing, and `manage.py check` warns how many such staff users there are (relay.W010).
"""

from django.contrib.auth.management import create_permissions
from django.db import migrations

OPERATORS_GROUP = "Operators"


def add_operators_group(apps, schema_editor):
    relay = apps.get_app_config("relay")
    # Permissions are normally created after all migrations ran; the group needs them now.
    relay.models_module = True
    create_permissions(relay, verbosity=0, apps=apps)
    relay.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    group, _ = Group.objects.get_or_create(name=OPERATORS_GROUP)
    group.permissions.add(*Permission.objects.filter(content_type__app_label="relay"))


class Migration(migrations.Migration):

    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("relay", "0003_delivery_coalesced"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="tenant",
            options={
                "ordering": ["name"],
                "permissions": [
                    ("operate_all_tenants", "Can see and change every tenant (operator)")
                ],
            },
        ),
        migrations.RunPython(add_operators_group, migrations.RunPython.noop),
    ]
