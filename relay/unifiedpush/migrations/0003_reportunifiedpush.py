from django.db import migrations, models


def move_content_type(apps, schema_editor):
    content_types = apps.get_model("contenttypes", "ContentType")
    content_types.objects.filter(app_label="relay", model="reportunifiedpush").update(
        app_label="unifiedpush"
    )


def move_content_type_back(apps, schema_editor):
    content_types = apps.get_model("contenttypes", "ContentType")
    content_types.objects.filter(app_label="unifiedpush", model="reportunifiedpush").update(
        app_label="relay"
    )


class Migration(migrations.Migration):

    dependencies = [
        ('unifiedpush', '0002_componentsettings'),
        ('relay', '0018_webpush'),
        ('contenttypes', '0002_remove_content_type_name'),
    ]

    # The table was made by relay.0013_unifiedpush_reports and keeps its name and indexes (the
    # Spark reports write it by name): state only, and the content type (and so any permission
    # on it) follows the model here.
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='ReportUnifiedPush',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('day', models.DateField()),
                        ('tenant_id', models.BigIntegerField(blank=True, null=True)),
                        ('tenant_name', models.CharField(blank=True, max_length=100)),
                        ('component_id', models.BigIntegerField(blank=True, null=True)),
                        ('component_name', models.CharField(blank=True, max_length=255)),
                        ('received', models.BigIntegerField(default=0)),
                        ('delivered', models.BigIntegerField(default=0)),
                        ('expired', models.BigIntegerField(default=0)),
                        ('revoked', models.BigIntegerField(default=0)),
                        ('replaced', models.BigIntegerField(default=0)),
                        ('withdrawn', models.BigIntegerField(default=0)),
                        ('dropped', models.BigIntegerField(default=0)),
                        ('bytes_relayed', models.BigIntegerField(default=0)),
                    ],
                    options={
                        'verbose_name': 'UnifiedPush report',
                        'db_table': 'relay_reportunifiedpush',
                        'ordering': ['-day', 'tenant_name', 'component_name'],
                        'indexes': [models.Index(fields=['day'], name='relay_repor_day_2dc920_idx'), models.Index(fields=['tenant_id'], name='relay_repor_tenant__0570c9_idx')],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(move_content_type, move_content_type_back),
    ]
