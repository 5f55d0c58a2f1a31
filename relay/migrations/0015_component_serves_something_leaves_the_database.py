from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('relay', '0014_wnsdevice_moves_to_windows'),
    ]

    # What a component serves beyond its app now lives in the feature apps' tables, which a
    # check constraint cannot see: the rule is the admin's and load_tenants' (and UnifiedPush's
    # lifetime is checked on its own table, unifiedpush.0002).
    operations = [
        migrations.RemoveConstraint(
            model_name='component',
            name='component_serves_something',
        ),
        migrations.RemoveConstraint(
            model_name='component',
            name='component_unifiedpush_lifetime_positive',
        ),
    ]
