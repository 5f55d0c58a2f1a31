import django.db.models.deletion
from django.db import migrations, models


def move_content_type(apps, schema_editor):
    content_types = apps.get_model("contenttypes", "ContentType")
    content_types.objects.filter(app_label="relay", model="wnsdevice").update(
        app_label="windows"
    )


def move_content_type_back(apps, schema_editor):
    content_types = apps.get_model("contenttypes", "ContentType")
    content_types.objects.filter(app_label="windows", model="wnsdevice").update(
        app_label="relay"
    )


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('relay', '0013_unifiedpush_reports'),
        ('contenttypes', '0002_remove_content_type_name'),
    ]

    # The table was made by relay.0001_initial and keeps its name, index and constraint:
    # state only, and the content type (and so any permission on it) follows the model here.
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='WnsDevice',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('device_id_hash', models.CharField(max_length=64)),
                        ('channel_uri', models.TextField()),
                        ('created', models.DateTimeField(auto_now_add=True)),
                        ('updated', models.DateTimeField(auto_now=True, help_text='Last time the client updated it.')),
                        ('app', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='wns_devices', to='relay.app')),
                    ],
                    options={
                        'db_table': 'relay_wnsdevice',
                        'indexes': [models.Index(fields=['updated'], name='relay_wnsde_updated_5bf6d9_idx')],
                        'constraints': [models.UniqueConstraint(fields=('app', 'device_id_hash'), name='wnsdevice_unique_device_per_app')],
                    },
                ),
            ],
        ),
        migrations.RunPython(move_content_type, move_content_type_back),
    ]
