from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('relay', '0015_component_serves_something_leaves_the_database'),
        # Its rows were copied there first (and are copied back when this is undone).
        ('unifiedpush', '0002_componentsettings'),
    ]

    operations = [
        migrations.RemoveField(
            model_name='component',
            name='unifiedpush_endpoint_url',
        ),
        migrations.RemoveField(
            model_name='component',
            name='unifiedpush_token_lifetime_days',
        ),
        migrations.AlterField(
            model_name='component',
            name='app',
            field=models.ForeignKey(blank=True, help_text='The app whose devices register here with the p2 commands (FCM, APNs, WNS); empty for a component that serves only what a feature adds (see below).', null=True, on_delete=models.deletion.PROTECT, related_name='components', to='relay.app'),
        ),
    ]
