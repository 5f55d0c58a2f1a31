from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('relay', '0009_retention_cut'),
        ('unifiedpush', '0001_initial'),
    ]

    # The tables stay (their names too): only the models' home changes, to the unifiedpush app.
    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name='unifiedpushmessage',
                    name='component',
                ),
                migrations.RemoveField(
                    model_name='unifiedpushmessage',
                    name='tenant',
                ),
                migrations.RemoveField(
                    model_name='unifiedpushrevocation',
                    name='tenant',
                ),
                migrations.DeleteModel(
                    name='UnifiedPushDelivery',
                ),
                migrations.DeleteModel(
                    name='UnifiedPushMessage',
                ),
                migrations.DeleteModel(
                    name='UnifiedPushRevocation',
                ),
            ],
        ),
    ]
