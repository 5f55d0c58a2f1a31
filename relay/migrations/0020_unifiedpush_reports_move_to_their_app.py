from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('relay', '0019_registration_wns_device_leaves_the_core'),
        ('unifiedpush', '0003_reportunifiedpush'),
    ]

    # The table stays (its name and indexes too): only the model's home changes, to the
    # unifiedpush app.
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(
                    name='ReportUnifiedPush',
                ),
            ],
            database_operations=[],
        ),
    ]
