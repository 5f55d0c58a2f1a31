import django.core.validators
import django.db.models.deletion
from django.db import migrations, models


def copy_from_components(apps, schema_editor):
    """A component that served UnifiedPush (an endpoint URL) gets its settings row."""
    components = apps.get_model("relay", "Component")
    settings = apps.get_model("unifiedpush", "ComponentSettings")
    settings.objects.bulk_create(
        [
            settings(
                component_id=pk,
                endpoint_url=url,
                token_lifetime_days=days,
            )
            for pk, url, days in components.objects.exclude(unifiedpush_endpoint_url="")
            .values_list("pk", "unifiedpush_endpoint_url", "unifiedpush_token_lifetime_days")
            .iterator()
        ],
        batch_size=1000,
    )


def copy_back_to_components(apps, schema_editor):
    components = apps.get_model("relay", "Component")
    settings = apps.get_model("unifiedpush", "ComponentSettings")
    for row in settings.objects.iterator():
        components.objects.filter(pk=row.component_id).update(
            unifiedpush_endpoint_url=row.endpoint_url,
            unifiedpush_token_lifetime_days=row.token_lifetime_days,
        )


class Migration(migrations.Migration):

    dependencies = [
        ('unifiedpush', '0001_initial'),
        ('relay', '0015_component_serves_something_leaves_the_database'),
    ]

    operations = [
        migrations.CreateModel(
            name='ComponentSettings',
            fields=[
                ('component', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='unifiedpush_settings', serialize=False, to='relay.component')),
                ('endpoint_url', models.URLField(help_text='Public base URL of this relay\'s web process (or its reverse proxy), e.g. https://push.example.org; endpoints are built on it.', verbose_name='UnifiedPush endpoint URL')),
                ('token_lifetime_days', models.PositiveSmallIntegerField(default=7, help_text='Conversations renews an endpoint when less than a day is left.', validators=[django.core.validators.MinValueValidator(1)], verbose_name='UnifiedPush endpoint lifetime (days)')),
            ],
            options={
                'verbose_name': 'UnifiedPush',
                'verbose_name_plural': 'UnifiedPush',
                'constraints': [models.CheckConstraint(condition=models.Q(('token_lifetime_days__gte', 1)), name='unifiedpush_lifetime_positive'), models.CheckConstraint(condition=models.Q(('endpoint_url', ''), _negated=True), name='unifiedpush_endpoint_url_given')],
            },
        ),
        migrations.RunPython(copy_from_components, copy_back_to_components),
    ]
