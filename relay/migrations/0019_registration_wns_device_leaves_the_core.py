from django.db import migrations


class Migration(migrations.Migration):

    # The links were copied into the windows app's table first.
    dependencies = [
        ('relay', '0018_webpush'),
        ('windows', '0002_wnsaccount'),
    ]

    operations = [
        migrations.RemoveField(
            model_name='registration',
            name='wns_device',
        ),
    ]
