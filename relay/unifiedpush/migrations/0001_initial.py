import django.db.models.deletion
from django.db import migrations, models

MODELS = ["unifiedpushmessage", "unifiedpushrevocation", "unifiedpushdelivery"]


def move_content_types(apps, schema_editor):
    content_types = apps.get_model("contenttypes", "ContentType")
    content_types.objects.filter(app_label="relay", model__in=MODELS).update(
        app_label="unifiedpush"
    )


def move_content_types_back(apps, schema_editor):
    content_types = apps.get_model("contenttypes", "ContentType")
    content_types.objects.filter(app_label="unifiedpush", model__in=MODELS).update(
        app_label="relay"
    )


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('relay', '0009_retention_cut'),
        ('contenttypes', '0002_remove_content_type_name'),
    ]

    # The tables were made by relay.0006_unifiedpush and keep their names: state only, and
    # the content types (and so the permissions staff groups hold) follow the models here.
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='UnifiedPushRevocation',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('endpoint_key', models.CharField(max_length=32, unique=True)),
                        ('created', models.DateTimeField(auto_now_add=True)),
                        ('expires', models.DateTimeField(db_index=True)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='relay.tenant')),
                    ],
                    options={
                        'db_table': 'relay_unifiedpushrevocation',
                    },
                ),
                migrations.CreateModel(
                    name='UnifiedPushDelivery',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('outcome', models.CharField(choices=[('delivered', 'delivered (the phone answered result)'), ('expired', 'expired (TTL passed before the phone took it)'), ('revoked', 'revoked (the phone said item-not-found)'), ('replaced', 'replaced (a newer message with the same Topic)'), ('withdrawn', 'withdrawn (DELETE by the application server)'), ('dropped', "dropped (the endpoint's storage was full)")], max_length=16)),
                        ('urgency', models.SmallIntegerField(choices=[(0, 'very-low'), (1, 'low'), (2, 'normal'), (3, 'high')])),
                        ('received', models.DateTimeField()),
                        ('finished', models.DateTimeField(help_text='Delivered, or when it ended otherwise.')),
                        ('size', models.PositiveIntegerField(help_text='Body bytes.')),
                        ('ttl', models.PositiveIntegerField(help_text='Seconds granted.')),
                        ('attempts', models.PositiveSmallIntegerField(default=0)),
                        ('component', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='relay.component')),
                        ('tenant', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='relay.tenant')),
                    ],
                    options={
                        'verbose_name': 'UnifiedPush delivery',
                        'verbose_name_plural': 'UnifiedPush deliveries',
                        'db_table': 'relay_unifiedpushdelivery',
                        'ordering': ['-received'],
                        'indexes': [models.Index(fields=['tenant', 'received'], name='up_delivery_tenant'), models.Index(fields=['outcome', 'received'], name='up_delivery_outcome')],
                    },
                ),
                migrations.CreateModel(
                    name='UnifiedPushMessage',
                    fields=[
                        ('id', models.BigAutoField(primary_key=True, serialize=False)),
                        ('endpoint_key', models.CharField(max_length=32)),
                        ('recipient_key', models.CharField(max_length=32)),
                        ('topic_key', models.CharField(blank=True, default='', max_length=32)),
                        ('urgency', models.SmallIntegerField(choices=[(0, 'very-low'), (1, 'low'), (2, 'normal'), (3, 'high')], default=2)),
                        ('received', models.DateTimeField()),
                        ('expires', models.DateTimeField()),
                        ('endpoint_expires', models.DateTimeField(help_text="When the endpoint's token expires.")),
                        ('next_attempt', models.DateTimeField()),
                        ('attempts', models.PositiveSmallIntegerField(default=0)),
                        ('size', models.PositiveIntegerField(help_text='Body bytes as POSTed.')),
                        ('ttl', models.PositiveIntegerField(help_text='Seconds granted.')),
                        ('sealed', models.BinaryField()),
                        ('component', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='relay.component')),
                        ('tenant', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='relay.tenant')),
                    ],
                    options={
                        'db_table': 'relay_unifiedpushmessage',
                        'indexes': [models.Index(fields=['endpoint_key'], name='up_message_endpoint'), models.Index(fields=['recipient_key'], name='up_message_recipient'), models.Index(fields=['component', 'next_attempt'], name='up_message_due'), models.Index(fields=['expires'], name='up_message_expires')],
                    },
                ),
            ],
        ),
        migrations.RunPython(move_content_types, move_content_types_back),
    ]
