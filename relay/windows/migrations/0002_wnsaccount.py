import django.db.models.deletion
from django.db import migrations, models

# Every registration that points at a device gets its link; backwards, the links go back
# into the column (relay.0019 re-adds it first when unapplied).
COPY_LINKS = (
    "INSERT INTO windows_wnsaccount (registration_id, device_id)"
    " SELECT id, wns_device_id FROM relay_registration WHERE wns_device_id IS NOT NULL"
)
COPY_LINKS_BACK = (
    "UPDATE relay_registration SET wns_device_id = (SELECT a.device_id FROM windows_wnsaccount a"
    " WHERE a.registration_id = relay_registration.id)"
)


class Migration(migrations.Migration):

    dependencies = [
        ('relay', '0018_webpush'),
        ('windows', '0001_initial'),
    ]

    operations = [
        migrations.CreateModel(
            name='WnsAccount',
            fields=[
                ('registration', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='wns_account', serialize=False, to='relay.registration')),
                ('device', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='accounts', to='windows.wnsdevice')),
            ],
        ),
        migrations.RunSQL(COPY_LINKS, COPY_LINKS_BACK),
    ]
