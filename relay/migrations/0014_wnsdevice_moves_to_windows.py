import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('relay', '0013_unifiedpush_reports'),
        ('windows', '0001_initial'),
    ]

    # The table stays (its name too): only the model's home changes, to the windows app, and
    # the registrations' foreign key points there.
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='registration',
                    name='wns_device',
                    field=models.ForeignKey(blank=True, help_text='Set for accounts registered over the Windows (UWPX) API.', null=True, on_delete=django.db.models.deletion.CASCADE, related_name='registrations', to='windows.wnsdevice'),
                ),
                migrations.DeleteModel(
                    name='WnsDevice',
                ),
            ],
        ),
    ]
